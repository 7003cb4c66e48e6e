"""``hvd-partialfc``: the command line (its subcommands parse, build, call and clean up; ``ABOUT`` is its help).

    hvd-partialfc train  [--config FILE] [--shards DIR] [--out RUN] [--steps N] [--set key=value ...]
    hvd-partialfc simulate --ranks N [the train options]   (N virtual ranks in one process, no horovodrun)
    hvd-partialfc export RUN --rank K --out backbone.pt [--onnx]
    hvd-partialfc info   RUN [--json]
    hvd-partialfc reshard RUN|CKPT --world-size M --out DIR
    hvd-partialfc upgrade RUN|CKPT                  (checkpoints written before format 2, once)
    hvd-partialfc eval   --backbone FILE|RUN [--pairs PAIRS ...] [--all-pairs SHARDS ...] [--flip] [--baselines]
                         [--ijb DIR --ijb-name IJBC|IJBB] [--identification SHARDS ...] [--model NAME]
                         [--batch-size N] [--workers N] [--threads N] [--out DIR]   (docs/evaluation.md)
    hvd-partialfc bench  [--classes 10000,...] [--dims 128,512] [--modes local,global,replicated] [--plot]
    hvd-partialfc profile [the train options] [--profile-out DIR] [--warmup N] [--profile-steps N] [--torch-trace]
    hvd-partialfc estimate --classes C --world-size N --dim D --batch B --backbone NAME [--mode ...] [--dtype ...]
                           [--memory-every K [--ranks-per-node R]]   (host memory of memory snapshots)
    hvd-partialfc config --list | --markdown [PATH]     (every config key: docs/configuration.md)
    hvd-partialfc doctor [--engine E] [--out RUN] [--config FILE] [--shards DIR [--np N]]

A user's mistake ends with one line and exit status 2; --debug or HVD_PARTIALFC_DEBUG=1 adds its traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from .cli_support import finish_subcommands, freeze_at_exit, offline_user_errors, record_exit, run_command
from .cli_train import run_simulate as _simulate, run_train as _train, train_config as _train_config


def _export(args) -> int:
    from .tools.export import export_backbone
    if args.onnx:
        from .tools.onnx_export import export_onnx_file
        info = export_onnx_file(args.run, args.out, args.rank)
    else:
        info = export_backbone(args.run, args.out, args.rank)
    print(json.dumps(info, indent=1))
    return 0


def _reshard(args) -> int:
    from .run.ckpt.reshard import reshard_checkpoint
    out = reshard_checkpoint(args.checkpoint, args.out, args.world_size)
    print(f"wrote {out} for {args.world_size} ranks; resume with --resume {out}")
    return 0


def _upgrade(args) -> int:
    from .run.ckpt.upgrade import upgrade_run
    done = upgrade_run(args.run)
    print("\n".join(f"upgraded {d}" for d in done) if done else f"{args.run}: already the current format")
    return 0


def _info(args) -> int:
    from .tools.export import run_summary
    s = run_summary(args.run)
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    print(f"checkpoint {s['checkpoint']}  step {s['step']}/{s['total_steps']}  world size {s['world_size']}  "
          f"classes {s['num_classes']}  backbone {s['model']['name']}  digests agree: {s['digests_agree']}")
    for r in s["ranks"]:
        print(f"  rank {r['rank']:>4}  labels [{r['label_start']}, {r['label_end']})  "
              f"classifier {r['classifier_shape']}  digest {r['digest'][:16]}")
    from .run.watch.stragglers import event_line
    for e in s["stragglers"]:
        print(f"  straggler {event_line(e)}")
    return 0


def _eval(args) -> int:
    import torch
    from .verification.suite import IJBRequest, PlainStateDict, evaluate_files
    if args.threads:
        torch.set_num_threads(args.threads)
    ijb = IJBRequest(args.ijb, args.ijb_name, not args.ijb_no_flip, not args.no_norm_score, not args.no_detector_score,
                     args.workers) if args.ijb else None
    plain = PlainStateDict(args.model, tuple(args.in_shape), args.embedding_dim) if args.model else None
    result = evaluate_files(args.backbone, args.pairs or [], flip=args.flip, baselines=args.baselines,
                            batch_size=args.batch_size, out_dir=args.out, all_pairs_dirs=args.all_pairs or [],
                            ijb=ijb, identification_dirs=args.identification or [], plain=plain,
                            onnx_input=args.onnx_input)
    print(f"backbone {result['backbone']}  flip {'on' if args.flip else 'off'}")
    for table in result["tables"]:
        print()
        print(table)
    print("\nwrote " + " and ".join(f for f in result["files"].values() if f))
    return 0


def _profile(args) -> int:
    """The trainer's step, phase by phase (tools/step_profile.py), under the launcher that started it."""
    from .tools.step_profile import run
    return run(_train_config(args), args)


def _bench(args) -> int:
    from .tools.bench import run_bench
    run_bench(args)
    return 0


def _estimate(args) -> int:
    from .tools.estimate import estimate, table
    from .classifier.modes import get_mode, list_modes
    modes = args.mode or list_modes()
    snaps = {"memory_every": args.memory_every, "ranks_per_node": args.ranks_per_node}   # host rows when > 0
    results = [estimate(args.classes, args.world_size, args.dim, args.batch, args.backbone, m, args.dtype,
                        optimizer=args.optimizer, sample_rate=args.sample_rate, in_shape=args.in_shape, **snaps)
               for m in modes]
    if args.negatives_every:   # beside the first mode that takes cross-shard negatives (the method)
        with_negatives = next(m for m in list_modes() if get_mode(m).negatives)
        results.insert(modes.index(with_negatives) + 1 if with_negatives in modes else 0, estimate(
            args.classes, args.world_size, args.dim, args.batch, args.backbone, with_negatives, args.dtype,
            optimizer=args.optimizer, in_shape=args.in_shape, negatives_every=args.negatives_every,
            negatives_share=args.negatives_share, negatives_pool=args.negatives_pool, **snaps))
    print(json.dumps(results, indent=1) if args.json else table(results))
    if not args.json:
        print(f"\nbackbone {args.backbone}: {results[0]['backbone_params']:,} parameters")
    return 0


def _config(args) -> int:
    """Every config key: a plain table (--list), docs/configuration.md's markdown (--markdown [PATH]), or an
    arcface_torch config file translated (--from-arcface FILE)."""
    from .config_docs import key_rows, plain_table, write_markdown
    if args.from_arcface:
        from .tools.arcface_config import run as from_arcface
        return from_arcface(args)
    if args.list:
        print(plain_table(key_rows()))
        return 0
    text = write_markdown(args.markdown)
    if args.markdown == "-":
        print(text, end="")
    else:
        print(f"wrote {args.markdown}")
    return 0


EXAMPLES = {
    "train": ["horovodrun -np 8 hvd-partialfc train --config configs/ms1mv3_r50.yaml --shards shards/train "
              "--out runs/r50",
              "hvd-partialfc train --config configs/demo.yaml --shards data/fonts-gb2312 --out runs/demo --steps 100 "
              "--set optim.backbone_lr=0.05"],
    "simulate": ["hvd-partialfc simulate --ranks 64 --config configs/demo.yaml --shards data/fonts-gb2312 "
                 "--out runs/sim64 --steps 10"],
    "export": ["hvd-partialfc export runs/r50 --out backbone.pt",
               "hvd-partialfc export runs/r50 --onnx --out r50.onnx"],
    "reshard": ["hvd-partialfc reshard runs/r50 --world-size 4 --out runs/r50-4ranks",
                "horovodrun -np 4 hvd-partialfc train --config configs/ms1mv3_r50.yaml --shards shards/train "
                "--out runs/r50 --resume runs/r50-4ranks"],
    "upgrade": ["hvd-partialfc upgrade runs/old-run"],
    "info": ["hvd-partialfc info runs/r50", "hvd-partialfc info runs/r50 --json"],
    "eval": ["hvd-partialfc eval --backbone runs/r50 --pairs val/lfw.bin --pairs val/cfp_fp.bin --flip",
             "hvd-partialfc eval --backbone runs/r50 --ijb IJB_release/IJBC --ijb-name IJBC"],
    "bench": ["hvd-partialfc bench --classes 10000,100000 --dims 128 --modes local,global --np 2"],
    "profile": ["hvd-partialfc profile --config configs/ms1mv3_r50.yaml --shards shards/train --profile-out runs/prof "
                "--torch-trace",
                "torchrun --nproc-per-node 2 -m hvd_partialfc.cli profile --config configs/demo.yaml --shards "
                "data/fonts-gb2312 --set train.device=cpu"],
    "estimate": ["hvd-partialfc estimate --classes 1e6 --world-size 64 --dim 512 --batch 128 --backbone iresnet50"],
    "config": ["hvd-partialfc config --list", "hvd-partialfc config --markdown docs/configuration.md",
               "hvd-partialfc config --from-arcface arcface_torch/configs/ms1mv3_r50.py --world-size 8 --out r50.yaml"],
    "import-arcface": ["hvd-partialfc import-arcface work_dirs/ms1mv3_r50 --shards shards/ms1mv3 --config r50.yaml "
                       "--out runs/r50"],
    "doctor": ["hvd-partialfc doctor --engine horovod --out runs/r50",
               "hvd-partialfc doctor --shards shards/train --np 64 --config configs/ms1mv3_r50.yaml"],
}


def _train_arguments(t) -> None:
    """The options of ``train`` (and ``simulate``)."""
    t.add_argument("--config", help="YAML config (sections: data, model, head, optim, train, checkpoint)")
    t.add_argument("--shards", help="shard set directory (= --set data.shards=DIR)")
    t.add_argument("--out", help="run directory (= --set out=DIR)")
    t.add_argument("--steps", type=int, help="optimizer steps (= --set train.steps=N)")
    t.add_argument("--resume", help="auto | checkpoint path (= --set checkpoint.resume=...)")
    t.add_argument("--classifier", metavar="MODE",
                   help="local: the method; global: exact model-parallel softmax; replicated: data parallel "
                        "(= --set head.mode=...)")
    t.add_argument("--sample-rate", type=float,
                   help="global, local: fraction of the slice's centres scored per step, positives always "
                        "(PartialFC's sampling; = --set head.sample_rate=...)")
    t.add_argument("--init-backbone", metavar="FILE",
                   help="start the backbone from an exported backbone or an arcface_torch backbone.pth; the "
                        "classifier starts fresh; not re-applied on resume (= --set model.init_backbone=FILE)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. optim.backbone_lr=0.05")


ABOUT = """Train a face-recognition (or any many-class) model over millions of classes on many GPUs: every rank
holds its own slice of the classifier and reads only its classes' samples; the backbone is averaged across
ranks (Horovod or torch.distributed). Then evaluate it (IJB-B/C, pairs, 1:N) and export it (ONNX)."""


def _train_parsers(sub) -> None:
    """train and simulate: the same options, as real ranks or as N virtual ranks in one process."""
    t = sub.add_parser("train", help="train under torchrun, horovodrun or mpirun (or alone, as one rank; train.engine, docs/engines.md)")
    _train_arguments(t)
    t.set_defaults(fn=_train)
    m = sub.add_parser("simulate", help="train as N virtual ranks in one process, with a real N-rank run's "
                                        "numbers (docs/simulate.md)")
    m.add_argument("--ranks", type=int, required=True, help="virtual ranks (at most the shard count)")
    _train_arguments(m)
    m.set_defaults(fn=_simulate)


def _checkpoint_parsers(sub) -> None:
    """export, reshard, upgrade and info: the subcommands that read a run's checkpoints."""
    e = sub.add_parser("export", help="write a standalone backbone from a run (after checking the digests)")
    e.add_argument("run", help="run folder or checkpoint folder")
    e.add_argument("--rank", type=int, default=0, help="whose copy (all must agree)")
    e.add_argument("--out", required=True, help="output file, e.g. backbone.pt")
    e.add_argument("--onnx", action="store_true",
                   help="write an ONNX model (dynamic batch, float32 NCHW input normalised to [-1, 1], output "
                        "the embedding), checked against PyTorch with onnxruntime (docs/faces.md)")
    e.set_defaults(fn=_export)
    r = sub.add_parser("reshard", help="redistribute a checkpoint's classifier rows to another world size")
    r.add_argument("checkpoint", help="run folder (its latest checkpoint) or checkpoint folder")
    r.add_argument("--world-size", type=int, required=True)
    r.add_argument("--out", required=True, help="new checkpoint folder (resume from it with --resume)")
    r.set_defaults(fn=_reshard)
    u = sub.add_parser("upgrade", help="convert checkpoints written before format 2 (loads them with full "
                                       "unpickling: only for checkpoints you wrote)")
    u.add_argument("run", help="run folder (every checkpoint) or checkpoint folder")
    u.set_defaults(fn=_upgrade)
    i = sub.add_parser("info", help="summary of a run: ranks, label slices, classifier shapes, digests")
    i.add_argument("run")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=_info)


def _eval_parser(sub) -> None:
    """eval: every open-set protocol a backbone is measured by (docs/evaluation.md)."""
    v = sub.add_parser("eval", help="open-set evaluation: pair sets, all pairs, IJB-B/C, 1:N identification")
    v.add_argument("--backbone", required=True, help="exported backbone file, checkpoint folder, run folder or "
                                                     ".onnx model")
    v.add_argument("--pairs", action="append", help=".h5 pair set or LFW-style .bin (repeatable)")
    v.add_argument("--all-pairs", action="append", metavar="SHARDS",
                   help="a held-out shard set, verified over every pair of its samples (repeatable)")
    v.add_argument("--flip", action="store_true", help="add the mirror image's embedding (faces; not glyphs)")
    v.add_argument("--baselines", action="store_true", help="also raw pixels and the random-init backbone")
    v.add_argument("--ijb", metavar="DIR", help="IJB-B/C release folder (loose_crop/, meta/): 1:1 template verification")
    v.add_argument("--ijb-name", default="IJBC", type=str.upper, choices=["IJBC", "IJBB"])
    v.add_argument("--ijb-no-flip", action="store_true", help="IJB: no mirror-image embedding (on by default, "
                                                              "as InsightFace; glyphs: turn it off)")
    v.add_argument("--no-norm-score", action="store_true", help="IJB: L2-normalise image features before pooling")
    v.add_argument("--no-detector-score", action="store_true", help="IJB: no weighting by the detector's score")
    v.add_argument("--identification", action="append", metavar="SHARDS",
                   help="a held-out shard set: 1:N search, seeded gallery/probe split (repeatable)")
    v.add_argument("--model", help="for a plain state_dict file (arcface_torch's backbone.pth): the registered "
                                   "backbone it loads into")
    v.add_argument("--in-shape", type=lambda x: [int(n) for n in x.split(",")], default=[112, 112, 3],
                   help="with --model: the input shape H,W[,C] (default 112,112,3)")
    v.add_argument("--embedding-dim", type=int, default=512, help="with --model: the embedding width")
    v.add_argument("--onnx-input", choices=("auto", "normalized", "pixels"), default="auto",
                   help="an .onnx backbone's input: (pixel - 127.5) / 127.5 or raw pixels (auto: raw where the "
                        "graph normalises itself, as MXNet-converted InsightFace models do)")
    v.add_argument("--batch-size", type=int, default=256)
    v.add_argument("--workers", type=int, default=0, help="IJB: image-reading processes (0: in this process)")
    v.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    v.add_argument("--out", help="output folder (default: the run/checkpoint folder, or beside the file)")
    v.set_defaults(fn=_eval)


def _measure_parsers(sub) -> None:
    """bench, profile and estimate: the subcommands that measure or predict a run's cost."""
    from .tools.bench import add_arguments as bench_arguments
    b = sub.add_parser("bench", help="local vs global vs replicated vs the limit, synthetic data (docs/benchmarks.md)")
    bench_arguments(b)
    b.set_defaults(fn=_bench)
    from .tools.step_profile import add_arguments as profile_arguments
    f = sub.add_parser("profile", help="where the training step's time goes: loader, copies, forward, backward, "
                                       "gradient averaging and its overlap, optimizers (docs/benchmarks.md)")
    _train_arguments(f)
    profile_arguments(f)
    f.set_defaults(fn=_profile)
    from .tools.estimate import add_arguments as estimate_arguments
    s = sub.add_parser("estimate", help="per-rank memory and per-step traffic of each mode (docs/scaling.md)")
    estimate_arguments(s)
    s.set_defaults(fn=_estimate)


def _setup_parsers(sub) -> None:
    """config, import-arcface and doctor: the subcommands that prepare a run."""
    c = sub.add_parser("config", help="every config key, its default, choices and what it does "
                                      "(docs/configuration.md)")
    what = c.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true", help="a plain table on stdout")
    what.add_argument("--markdown", metavar="PATH", nargs="?", const="-",
                      help="write docs/configuration.md's page to PATH (stdout without PATH)")
    from .tools.arcface_config import add_arguments as arcface_config_arguments
    arcface_config_arguments(c, what)
    c.set_defaults(fn=_config)
    from .tools import arcface_import
    a = sub.add_parser("import-arcface", help="an arcface_torch run's checkpoint_gpu_<rank>.pt files as this "
                                              "package's checkpoint, resumed at any GPU count (docs/migrate.md)")
    arcface_import.add_arguments(a)
    a.set_defaults(fn=arcface_import.run)
    from .tools.doctor import add_arguments as doctor_arguments, run_doctor
    d = sub.add_parser("doctor", help="what this machine has and lacks for a run (torch, GPUs, Horovod, "
                                      "torch.distributed, mpirun, fonts, run folder, a shard set); exit 1 when a "
                                      "requirement is missing")
    doctor_arguments(d)
    d.set_defaults(fn=run_doctor)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hvd-partialfc", description=ABOUT,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Examples:\n  " + "\n  ".join([EXAMPLES["train"][0], EXAMPLES["eval"][1]])
                                       + "\n  hvd-partialfc SUBCOMMAND --help")
    sub = p.add_subparsers(dest="cmd", required=True)
    _train_parsers(sub)
    _checkpoint_parsers(sub)
    _eval_parser(sub)
    _measure_parsers(sub)
    _setup_parsers(sub)
    finish_subcommands("hvd-partialfc", sub, EXAMPLES)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return _main(argv)
    finally:
        freeze_at_exit()      # the process's exit skips collections over torch's objects (cli_support.py)


def _main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd in ("train", "simulate", "profile"):   # before any rank starts: the config; the rest is rank_error's
        from .config import ConfigError
        from .engine.select import launcher_rank
        # the config is the same on every rank: rank 0 reports its error, the others only exit 2
        code = run_command("hvd-partialfc", args, args.fn, (ConfigError,), quiet=launcher_rank(os.environ) != 0)
        if args.cmd == "train":
            record_exit(code, os.environ)       # for a restart wrapper (launch/horovod_restarts.py)
        return code
    return run_command("hvd-partialfc", args, args.fn, offline_user_errors())


if __name__ == "__main__":
    sys.exit(main())
