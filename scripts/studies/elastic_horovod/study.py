"""Horovod elastic mode, recovering in the workers' own processes: measured scenarios (figures: FINDINGS.md).

    S="python -m scripts.studies.elastic_horovod.study"
    $S kill [--victim 1]                      # Q1, Q4: a worker SIGKILLed, 3 -> 2 (--gloo-timeout 5: shorter wait)
    $S kill --hosts localhost:3               # the same, three slots on one host
    $S remove                                 # Q2: a host leaves discovery, 3 -> 2
    $S add [--slow-newcomer 8]                # Q3: a host joins, 2 -> 3
    $S cycles --n 5 [--mode kill]             # Q5: 10 resets, a survivor's RSS / threads / fds
    $S async --how kill|stop                  # Q6: a pending allreduce_async_ when the peer is lost
    $S --gloo-timeout 5 --join-timeout 60 add --slow-newcomer 8     # two Gloo timeouts (worker.py)

``--gloo-timeout S`` and ``--join-timeout S`` come before the scenario. Each prints its measurements as JSON
(the last line) and the path of the job's raw log. Times are wall-clock (``time.time()``) of this machine's
processes, all on one clock. Every run ends within about two minutes: the job's ``horovodrun`` and workers are
killed past their timeouts.
"""
import argparse
import json
import os
import signal
import time

from .harness import HOSTS, Job


def r3(x):
    return round(x, 3)


def members_table(evs):
    return [dict(rank=e["rank"], pid=e["pid"], host=e["host"]) for e in evs]


def kill(args):
    """Q1/Q4: 3 workers, one SIGKILLed mid-run; the survivors' PIDs, ranks and the time to their first allreduce."""
    hosts = args.hosts.split(",") if args.hosts else [f"{h}:1" for h in HOSTS[:3]]
    env = {"STUDY_DURATION": "25"}
    if args.hosts:
        env["HOROVOD_ELASTIC_TIMEOUT"] = "15"           # the driver's wait for slots, if none are left
    job = Job(hosts, min_np=2, max_np=3, np=3, env=env)
    try:
        before = job.steady(3)
        time.sleep(2)
        victim = next(e for e in before if e["rank"] == args.victim)
        t_kill = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        try:
            firsts = job.wait_size(2, 2, after=t_kill, timeout=45)
        except (TimeoutError, RuntimeError) as e:
            firsts = []
            print("no recovery:", e)
        after = sorted(job.find("members", after=t_kill, size=2), key=lambda e: e["rank"])
        rc = job.finish(60)
    finally:
        job.finish(5)
    res = dict(scenario="kill", hosts=hosts, victim=dict(rank=victim["rank"], pid=victim["pid"], host=victim["host"]),
               before=members_table(before), after=members_table(after),
               interrupted_after_kill_s={e["pid"]: r3(e["t"] - t_kill) for e in job.find("interrupted", after=t_kill)},
               interrupt_kind=sorted({e["kind"] for e in job.find("interrupted", after=t_kill)}),
               reinit_s={e["pid"]: e["init_s"] for e in job.find("reinit", after=t_kill)},
               first_allreduce_after_kill_s={e["pid"]: r3(e["t"] - t_kill) for e in firsts},
               old_to_new=[{m["old_rank"]: e["rank"]} for e in after for m in e["members"] if m["pid"] == e["pid"]],
               done=[dict(rank=e["rank"], size=e["size"], pid=e["pid"]) for e in job.find("done")],
               horovodrun_rc=rc, log=job.log)
    return res


def remove(args):
    """Q2: a host stops being listed (its worker alive): what the others see, and when they run at size 2."""
    hosts = [f"{h}:1" for h in HOSTS[:3]]
    job = Job(hosts, min_np=2, max_np=3, np=3, env={"STUDY_DURATION": "25"})
    try:
        before = job.steady(3)
        time.sleep(2)
        t_w = job.set_hosts(hosts[:2])
        firsts = job.wait_size(2, 2, after=t_w, timeout=45)
        time.sleep(1)
        rc = job.finish(60)
    finally:
        job.finish(5)
    gone = HOSTS[2]
    return dict(scenario="remove", before=members_table(before),
                notified_after_write_s=[r3(e["t"] - t_w) for e in job.find("notified", after=t_w)],
                interrupted_after_write_s={e["host"]: [e["kind"], r3(e["t"] - t_w)]
                                           for e in job.find("interrupted", after=t_w)},
                removed_worker=[dict(host=e["host"], after_write_s=r3(e["t"] - t_w), error=e["error"])
                                for e in job.find("removed", after=t_w)],
                first_allreduce_size2_after_write_s={e["host"]: r3(e["t"] - t_w) for e in firsts},
                survivors_same_pid=all(any(b["pid"] == e["pid"] for b in before) for e in firsts),
                removed_host_lines=[l for l in job.lines if gone in l and "{" not in l][:6],
                horovodrun_rc=rc, log=job.log)


def add(args):
    """Q3: a host joins a running job of 2: when the others are interrupted, how long they pause, and the
    newcomer's own timeline (process start, torch imported, hvd.init done)."""
    hosts = [f"{h}:1" for h in HOSTS[:3]]
    env = {"STUDY_DURATION": "30"}
    if args.slow_newcomer:
        env.update(STUDY_SLOW_HOST=HOSTS[2], STUDY_START_DELAY=str(args.slow_newcomer))
    job = Job(hosts[:2], min_np=2, max_np=3, np=2, env=env)
    try:
        before = job.steady(2)
        time.sleep(2)
        t_w = job.set_hosts(hosts)
        try:
            firsts = job.wait_size(3, 3, after=t_w, timeout=60)
        except (TimeoutError, RuntimeError) as e:
            firsts = []
            print("no recovery:", e)
        rc = job.finish(60)
    finally:
        job.finish(5)
    old_pids = {e["pid"] for e in before}
    new = [e for e in job.find("start", after=t_w)]
    inter = {e["pid"]: e["t"] for e in job.find("interrupted", after=t_w)}
    return dict(scenario="add", before=members_table(before),
               notified_after_write_s=[r3(e["t"] - t_w) for e in job.find("notified", after=t_w)],
               old_interrupted_after_write_s={p: r3(t - t_w) for p, t in inter.items()},
               newcomer=[dict(host=e["host"], process_start_after_write_s=r3(e["t_process"] - t_w),
                              import_s=e["import_s"], init_s=e["init_s"],
                              process_start_minus_first_interrupt_s=r3(e["t_process"] - min(inter.values())))
                         for e in new],
               first_allreduce_size3_after_write_s={e["host"]: r3(e["t"] - t_w) for e in firsts},
               old_pause_s={e["pid"]: r3(e["t"] - inter[e["pid"]]) for e in firsts if e["pid"] in inter},
               old_same_pid=sorted(old_pids) == sorted(e["pid"] for e in firsts if e["pid"] in old_pids),
               after=members_table(sorted(job.find("members", after=t_w, size=3), key=lambda e: e["rank"])),
               timeline=[(r3(e["t"] - t_w), e["host"], e["ev"], e.get("kind", e.get("size"))) for e in job.events
                         if e["t"] >= t_w and e["ev"] not in ("members", "done")],
               horovodrun_rc=rc, log=job.log)


def cycles(args):
    """Q5: ``n`` cycles of losing and regaining the third host (2 resets each), a survivor's RSS/threads/fds.

    ``--mode remove``: the host leaves discovery and comes back. ``--mode kill``: its worker is SIGKILLed; the
    host is blacklisted and comes back after horovodrun's cooldown (``--blacklist-cooldown-range 1 2``)."""
    hosts = [f"{h}:1" for h in HOSTS[:3]]
    extra = ["--blacklist-cooldown-range", "1", "2"] if args.mode == "kill" else []
    job = Job(hosts, min_np=2, max_np=3, np=3, env={"STUDY_DURATION": "600"}, extra_args=extra)
    t0 = time.time()
    phases = []
    try:
        before = job.steady(3)
        watched = next(e for e in before if e["host"] != HOSTS[2])["pid"]   # a worker on a host that stays
        for i in range(args.n):
            if time.time() - t0 > args.budget:
                break
            t = time.time()
            if args.mode == "remove":
                job.set_hosts(hosts[:2])
            else:
                third = next(e for e in sorted(job.find("members", size=3), key=lambda e: e["t"])[-3:]
                             if e["host"] == HOSTS[2])
                os.kill(third["pid"], signal.SIGKILL)
            job.wait_size(2, 2, after=t, timeout=45)
            phases.append(("3->2", r3(time.time() - t)))
            t = time.time()                            # kill mode: the host comes back by itself (cooldown)
            if args.mode == "remove":
                time.sleep(1)
                t = job.set_hosts(hosts)
            job.wait_size(3, 3, after=t, timeout=60)
            phases.append(("2->3", r3(time.time() - t)))
            time.sleep(1)
    finally:
        res_rows = [dict(size=e["size"], rss_mb=e["rss_mb"], threads=e["threads"], fds=e["fds"])
                    for e in sorted(job.find("members"), key=lambda e: e["t"]) if e["pid"] == watched]
        os.killpg(job.proc.pid, signal.SIGKILL)
        job.finish(5)
    return dict(scenario="cycles", mode=args.mode, watched_pid=watched, resets=len(res_rows) - 1,
                phases_s=phases, survivor_resources=res_rows, log=job.log)


def async_(args):
    """Q6: a pending allreduce_async_ on rank 0 when rank 1 is SIGKILLed or SIGSTOPped."""
    env = {"STUDY_WATCHDOG": str(args.watchdog)}
    job = Job([f"{h}:1" for h in HOSTS[:2]], min_np=1, max_np=2, np=2, worker="async_worker.py", env=env)
    try:
        job.wait(lambda: job.find("submitted") and job.find("idle"), 90, "submitted and idle")
        time.sleep(1)
        peer = job.find("idle")[0]["pid"]
        t0 = time.time()
        os.kill(peer, signal.SIGKILL if args.how == "kill" else signal.SIGSTOP)
        ev = job.wait(lambda: (job.find("raised") or job.find("hang") or job.find("completed")),
                      args.watchdog + 15, "raised/hang")[0]
        time.sleep(2)
        if args.how == "stop":
            os.kill(peer, signal.SIGKILL)
        rc = job.finish(30)
        t_end = time.time()
    finally:
        job.finish(5)
    later = {e["ev"]: e for e in job.events}
    return dict(scenario="async", how=args.how,
                outcome=ev["ev"], after_signal_s=r3(ev["t"] - t0), kind=ev.get("kind"), msg=ev.get("msg"),
                shutdown=later.get("shutdown", later.get("shutdown_raised")),
                after=later.get("after_allreduce_ok", later.get("after_allreduce_raised")),
                horovodrun_rc=rc, horovodrun_end_after_signal_s=r3(t_end - t0), log=job.log)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gloo-timeout", type=int, default=0, dest="timeout",
                    help="HOROVOD_GLOO_TIMEOUT_SECONDS for the workers (Horovod's default: 30)")
    ap.add_argument("--join-timeout", type=int, default=0,
                    help="the Gloo timeout of each (re)init, followed by a reset under --gloo-timeout (worker.py)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kill")
    k.add_argument("--victim", type=int, default=1)
    k.add_argument("--hosts", default=None, help="comma-separated host:slots (default: three one-slot names)")
    sub.add_parser("remove")
    d = sub.add_parser("add")
    d.add_argument("--slow-newcomer", type=float, default=0, help="the newcomer sleeps this long before hvd.init")
    c = sub.add_parser("cycles")
    c.add_argument("--n", type=int, default=5)
    c.add_argument("--mode", choices=["remove", "kill"], default="remove")
    c.add_argument("--budget", type=float, default=100, help="no new cycle after this many seconds")
    a = sub.add_parser("async")
    a.add_argument("--how", choices=["kill", "stop"], default="kill")
    a.add_argument("--watchdog", type=float, default=60)
    args = ap.parse_args()
    if args.timeout:
        os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(args.timeout)
    if args.join_timeout:
        os.environ["STUDY_JOIN_TIMEOUT"] = str(args.join_timeout)
    fn = {"kill": kill, "remove": remove, "add": add, "cycles": cycles, "async": async_}[args.cmd]
    res = fn(args)
    res["gloo_timeout_s"] = args.timeout or "default (30)"
    res["join_timeout_s"] = args.join_timeout or None
    print(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
