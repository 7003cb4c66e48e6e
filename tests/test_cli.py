"""The console scripts as a user meets them: a mistake is one line on stderr and exit 2, no traceback
(--debug or HVD_PARTIALFC_DEBUG=1 adds it); a bug keeps its traceback; every subcommand's --help ends with
examples. No launcher: `python -m hvd_partialfc.cli` for the headline cases, main() in this process for
the rest (the console script is `sys.exit(main())`)."""
import configparser
import importlib
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def _cli(*args, env=None):
    e = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    e.pop("HVD_PARTIALFC_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "hvd_partialfc.cli", *map(str, args)], capture_output=True,
                          text=True, env=e, cwd=ROOT, timeout=120)


def _one_line(code, err, prefix, *words):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(prefix) and all(w in lines[0] for w in words), lines[0]


def test_a_config_typo_is_one_line_with_the_near_miss(tmp_path):
    p = _cli("train", "--shards", tmp_path, "--set", "optim.backbone_lrr=1")
    _one_line(p.returncode, p.stderr, "hvd-partialfc train: error: unknown config key 'optim.backbone_lrr'",
              "did you mean `optim.backbone_lr`?", "hvd-partialfc config --list")
    debug = _cli("train", "--shards", tmp_path, "--set", "optim.backbone_lrr=1", "--debug")
    assert debug.returncode == 2 and debug.stderr.startswith("Traceback") and "in load_config" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == p.stderr.strip()


def test_a_missing_shard_set_is_one_line_naming_the_command(tmp_path):
    """Found by the rank at start-up and agreed (one rank here): the rank's own line, once."""
    p = _cli("train", "--shards", tmp_path / "nowhere", "--out", tmp_path / "run")
    _one_line(p.returncode, p.stderr, "[rank 0] error: ShardError: ", "no manifest.json",
              "`hvd-partialfc-shards build`")
    assert not (tmp_path / "run" / "checkpoints").exists()


def _here(capsys, main, *args):
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.fixture
def cli(capsys, monkeypatch):
    from hvd_partialfc.cli import main
    monkeypatch.delenv("HVD_PARTIALFC_DEBUG", raising=False)
    return lambda *args: _here(capsys, main, *args)


def test_a_config_typo_under_a_launcher_is_printed_by_rank_0_only(cli, monkeypatch, tmp_path):
    """Every launched rank reads the same config: rank 0 prints the line, the others exit 2 silently."""
    argv = ("train", "--shards", tmp_path, "--set", "optim.backbone_lrr=1")
    for env in ({"RANK": "3", "WORLD_SIZE": "4"}, {"HOROVOD_RANK": "1"}, {"OMPI_COMM_WORLD_RANK": "2"},
                {"RANK": "0", "WORLD_SIZE": "4"}):
        for key in ("RANK", "WORLD_SIZE", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        code, err = cli(*argv)
        if env.get("RANK") == "0":
            _one_line(code, err, "hvd-partialfc train: error: unknown config key 'optim.backbone_lrr'")
        else:
            assert code == 2 and err == "", (env, err)


@pytest.mark.parametrize("args,words", [
    (["--set", "train.precision=fp61"], ["train.precision='fp61': expected one of fp32, bf16, fp16",
                                         "did you mean `fp16`?"]),
    (["--set", "data.batch_size=abc"], ["data.batch_size: expected int, got str 'abc'"]),
    (["--set", "trian.steps=3"], ["unknown config key 'trian'; did you mean `train`?"]),
    (["--set", "train.backbone_lr=1"], ["did you mean `optim.backbone_lr`?"]),     # the right key, wrong section
    (["--set", "data.augment=[flip"], ["--set data.augment=[flip: the value is not valid YAML"]),
    (["--config", "{tmp}/missing.yaml"], ["missing.yaml: cannot read the config file (No such file"]),
    (["--config", "{tmp}/bad.yaml"], ["bad.yaml: not valid YAML ("]),
])
def test_config_mistakes_are_one_line(cli, tmp_path, args, words):
    (tmp_path / "bad.yaml").write_text("data: {shards: [\n")
    code, err = cli("train", "--shards", tmp_path, *[a.format(tmp=tmp_path) for a in args])
    _one_line(code, err, "hvd-partialfc train: error: ", *words)


def test_file_and_launcher_mistakes_are_one_line(cli, tmp_path, monkeypatch):
    missing = tmp_path / "missing"
    for cmd in ("info", "export", "reshard"):
        extra = {"export": ["--out", tmp_path / "b.pt"], "reshard": ["--world-size", 2, "--out", tmp_path / "r"]}
        code, err = cli(cmd, missing, *extra.get(cmd, []))
        _one_line(code, err, f"hvd-partialfc {cmd}: error: {missing}: no such run or checkpoint folder",
                  "the --out of a training run")
    code, err = cli("eval", "--backbone", tmp_path / "b.pt", "--pairs", tmp_path / "p.h5")
    _one_line(code, err, "hvd-partialfc eval: error: ", "b.pt")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")          # as under mpirun: the torch engine does not fit
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    code, err = cli("train", "--shards", tmp_path, "--set", "train.engine=torch")
    _one_line(code, err, "hvd-partialfc train: error: train.engine=torch does not fit the launcher",
              "launch with torchrun")


def test_shards_cli_mistakes_are_one_line(capsys, monkeypatch, tmp_path):
    from data_tools.shards_cli import main
    monkeypatch.delenv("HVD_PARTIALFC_DEBUG", raising=False)
    for args, words in ((["inspect", tmp_path], ["no manifest.json", "`hvd-partialfc-shards build`"]),
                        (["build", "imagefolder", tmp_path / "none", "--out", tmp_path / "o", "--num-shards", 2],
                         ["not a folder"]),
                        (["build", "imagefolder", "--out", tmp_path / "o", "--num-shards", 2], ["SOURCE is required"]),
                        (["pairs", tmp_path / "none.bin", "--out", tmp_path / "p.h5"], ["no such pair set file"])):
        code, err = _here(capsys, main, *args)
        _one_line(code, err, f"hvd-partialfc-shards {args[0]}: error: ", *words)
    monkeypatch.setenv("HVD_PARTIALFC_DEBUG", "1")
    code, err = _here(capsys, main, "inspect", tmp_path)
    assert code == 2 and err.startswith("Traceback") and err.strip().splitlines()[-1].startswith(
        "hvd-partialfc-shards inspect: error: ")


def test_unknown_registry_names_say_did_you_mean(cli):
    code, err = cli("estimate", "--classes", "1e6", "--world-size", 8, "--backbone", "iresnet5")
    _one_line(code, err, "hvd-partialfc estimate: error: unknown backbone 'iresnet5'", "did you mean `iresnet50`?")
    code, err = cli("estimate", "--classes", "1e6", "--world-size", 8, "--mode", "locl")
    _one_line(code, err, "hvd-partialfc estimate: error: unknown classifier mode", "did you mean `local`?")


def test_a_bug_keeps_its_traceback(cli, monkeypatch):
    """An error that is not a user's mistake is not turned into one line (before: any RuntimeError was)."""
    import hvd_partialfc.tools.export as export

    def broken(run):
        raise RuntimeError("a bug in run_summary")
    monkeypatch.setattr(export, "run_summary", broken)
    with pytest.raises(RuntimeError, match="a bug in run_summary"):
        cli("info", "somewhere")


def test_agreed_errors_are_reported_once_per_job(capsys, monkeypatch):
    """rank_error: an agreed failure is printed by the reporter only (rank 0), in one line when every rank
    failed alike; a failure before training exits 2, one of the run itself 1 (and a bug keeps its traceback)."""
    import argparse
    from hvd_partialfc.cli_support import rank_error
    from hvd_partialfc.engine.base import RankFailure
    from hvd_partialfc.run.skips import NonFiniteError
    monkeypatch.delenv("HVD_PARTIALFC_DEBUG", raising=False)
    from hvd_partialfc.run.startup import checking_input
    args = argparse.Namespace(debug=False)

    def at_start_up(failure):           # raised by start-up's checks of the user's input: tagged there
        with pytest.raises(RankFailure), checking_input():
            raise failure
        return failure
    alike = at_start_up(RankFailure("2 of 2 ranks failed at 'setup': ...", "setup",
                                    [(0, "ShardError: D: bad"), (1, "ShardError: D: bad")]))
    capsys.readouterr()
    assert rank_error(alike, 1, 2, args, reporter=False) == 2 and capsys.readouterr().err == ""
    assert rank_error(alike, 0, 2, args, reporter=True) == 2
    assert capsys.readouterr().err == "[rank 0] error: ShardError: D: bad (every one of the 2 ranks)\n"
    one = RankFailure("1 of 2 ranks failed at 'setup':\n  rank 1: ShardError: D: bad", "setup",
                      [(1, "ShardError: D: bad")])
    assert rank_error(one, 0, 2, args, reporter=True) == 1          # the same failure, not from start-up's checks
    capsys.readouterr()
    assert rank_error(at_start_up(one), 0, 2, args, reporter=True) == 2
    assert capsys.readouterr().err.startswith("[rank 0] error: RankFailure: 1 of 2 ranks failed at 'setup'")
    late = RankFailure("1 of 2 ranks failed at 'ckpt.write.5': ...", "ckpt.write.5", [(1, "OSError: disk full")])
    assert rank_error(late, 0, 2, args, reporter=True) == 1
    assert rank_error(NonFiniteError("nan"), 1, 2, args, reporter=False) == 1
    assert capsys.readouterr().err.endswith("[rank 1] error: NonFiniteError: nan\n")      # its own: every rank
    try:
        raise TypeError("bug")
    except TypeError as bug:
        assert rank_error(bug, 0, 2, args, reporter=True) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("[rank 0] error: TypeError: bug\n")


def _console_scripts():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    lines = [l.strip() for l in cfg["options.entry_points"]["console_scripts"].splitlines() if l.strip()]
    return [(l.split("=")[0].strip(), l.split("=")[1].strip().split(":")[0]) for l in lines]


@pytest.mark.parametrize("prog,module", _console_scripts())
def test_every_subcommand_help_ends_with_examples(capsys, prog, module, monkeypatch):
    """Every console script of setup.cfg, and each of its subcommands (read from its usage line)."""
    import re
    mod = importlib.import_module(module)
    names = re.search(r"\{([^}]*)\}", mod.build_parser().format_usage()).group(1).split(",")
    assert len(names) >= 5
    monkeypatch.setattr(sys, "argv", [prog])
    for name in [None] + names:
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            mod.main(([name] if name else []) + ["--help"])
        text = capsys.readouterr().out.rstrip()
        assert done.value.code == 0 and "\nExamples:\n" in text, f"{prog} {name}: no Examples"
        tail = text[text.rindex("\nExamples:\n"):].splitlines()[2:]
        assert tail and all(l.startswith("  ") for l in tail), f"{prog} {name}: {tail}"
        assert f"{prog} {name or ''}".strip() + " " in tail[0], f"{prog} {name}: {tail[0]}"   # its own command first


def test_the_top_level_help_says_what_the_tool_does_and_its_commands_parse(capsys):
    """``hvd-partialfc --help`` opens with what the tool does (it opened with a note for developers) and its
    examples are commands the parser takes."""
    from hvd_partialfc.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    about = text.split("\n\n")[1]
    assert about.startswith("Train ") and "classes" in about and "subcommands" not in text.split("Examples:")[0]
    commands = [l.strip() for l in text[text.index("Examples:"):].splitlines()[1:] if "--help" not in l]
    assert [c.split("hvd-partialfc ")[1].split()[0] for c in commands] == ["train", "eval"]
    for c in commands:
        build_parser().parse_args(c.split("hvd-partialfc ")[1].split())
