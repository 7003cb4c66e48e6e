"""One config object: YAML + --set overrides; unknown keys and wrong types are errors."""
import os

import pytest

from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import diff_configs, dump_config, load_config


def test_defaults_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("data: {shards: /x, batch_size: 64}\noptim: {backbone_lr: 1}\n")
    cfg = load_config(str(p), ["optim.classifier_lr=0.5", "model.kwargs={width: 16}", "train.precision=bf16"])
    assert cfg.data.batch_size == 64 and cfg.optim.backbone_lr == 1.0 and isinstance(cfg.optim.backbone_lr, float)
    assert cfg.optim.classifier_lr == 0.5 and cfg.model.kwargs == {"width": 16}
    dump_config(cfg, str(tmp_path / "out.yaml"))
    again = load_config(str(tmp_path / "out.yaml"))
    assert diff_configs(cfg.to_dict(), again.to_dict()) == []


@pytest.mark.parametrize("override,match", [
    ("optim.backbone_lrr=0.1", "unknown config key 'optim.backbone_lrr'"),
    ("data.batch_size=abc", "data.batch_size: expected int"),
    ("data.batch_size=1.5", "expected int"),
    ("optim.schedule=linear", "expected one of cosine, poly, constant"),
    ("nosection.x=1", "unknown config key 'nosection'"),
    ("data=3", "expected a section"),
])
def test_bad_overrides_are_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["data.shards=/x", override])


def test_shards_required():
    with pytest.raises(ConfigError, match="data.shards is required"):
        load_config(None, [])


def test_diff_names_the_field():
    a = load_config(None, ["data.shards=/x"]).to_dict()
    b = load_config(None, ["data.shards=/x", "head.margin=0.3"]).to_dict()
    assert diff_configs(a, b) == ["head.margin: 0.5 != 0.3"]


CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# arcface_torch's published values (configs/<name>.py at deepinsight/insightface): loss, margin, weight decay,
# PartialFC sample rate; all: r50/r100, embedding 512, s=64, batch 128, SGD lr 0.1 momentum 0.9, 20 epochs, fp16.
RECIPES = {"ms1mv3_r50": ("iresnet50", "arcface", 0.5, 5e-4, 1.0),
           "ms1mv3_r100": ("iresnet100", "arcface", 0.5, 5e-4, 1.0),
           "glint360k_r50": ("iresnet50", "cosface", 0.4, 1e-4, 1.0),
           "glint360k_r100": ("iresnet100", "cosface", 0.4, 1e-4, 1.0),
           "wf4m_r50": ("iresnet50", "cosface", 0.4, 5e-4, 1.0),
           "wf42m_pfc02_r100": ("iresnet100", "cosface", 0.4, 5e-4, 0.2)}


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml")))
def test_every_config_in_configs_loads(name):
    # load_config validates keys, types and choices but builds no model: iresnet names need no registry here
    cfg = load_config(os.path.join(CONFIG_DIR, name + ".yaml"), ["data.shards=/x"])
    assert cfg.data.shards == "/x"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_face_recipes_translate_arcface_torch(name):
    model, loss, margin, wd, rate = RECIPES[name]
    path = os.path.join(CONFIG_DIR, name + ".yaml")
    c = load_config(path, ["data.shards=/x"])
    assert (c.model.name, c.model.embedding_dim, c.head.loss, c.head.scale, c.head.margin, c.head.sample_rate) == \
        (model, 512, loss, 64.0, margin, rate)
    assert (c.data.batch_size, c.data.augment, c.eval.flip, c.train.epochs, c.train.precision) == \
        (128, ["flip"], True, 20.0, "fp16")
    # workers follow the cores per GPU (2 decode ~6,400 faces/s with flip; docs/gpu.md); decode stays on PIL
    assert (c.data.workers, c.data.decode) == (-1, "cpu")
    o = c.optim
    assert (o.name, o.backbone_lr, o.classifier_lr, o.backbone_momentum, o.classifier_momentum) == \
        ("sgd", 0.1, 0.1, 0.9, 0.9)
    assert o.backbone_weight_decay == o.classifier_weight_decay == wd
    assert (o.schedule, o.poly_power, o.warmup_steps, o.clip_grad_norm) == ("poly", 1.0, 0, 5.0)
    assert f"arcface_torch's configs/{name}.py" in open(path).read()     # the comment names what it reproduces


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_face_recipes_run_the_method_and_say_how_to_get_partialfc(name):
    """A face recipe trains `local` with its defaults (cross-shard negatives; wf42m_pfc02 sampled at
    0.2), its header names the override to arcface_torch's exact method and what the evidence for the default
    is, and the fp16 loss scale grows as arcface_torch's GradScaler does."""
    from hvd_partialfc.config import HeadConfig
    path = os.path.join(CONFIG_DIR, name + ".yaml")
    c, d = load_config(path, ["data.shards=/x"]), HeadConfig()
    assert (c.head.mode, c.head.negatives_every, c.head.negatives_share, c.head.negatives_pool,
            c.head.sampled_step) == ("local", d.negatives_every, d.negatives_share, d.negatives_pool, d.sampled_step)
    assert c.train.loss_scale_growth == 100
    header = open(path).read().split("\ndata:")[0]
    for phrase in ("`--set head.mode=global`", "docs/accuracy.md", "CJK", "24,758 classes", "256 simulated ranks",
                   "not faces", "loss_scale_growth 100"):
        assert phrase in header, phrase
    assert "1,000 good steps" not in header


# today's lists, as resume.py spelled them before the policy moved beside each key (config.py's ``resume=``)
FREE_BEFORE = ("out", "checkpoint", "train.log_every", "train.threads", "train.device", "data.workers",
               "data.verify_sha256", "data.decode", "data.shards", "eval.batch_size", "eval.on_error",
               "data.on_bad_sample", "data.max_bad_samples", "train.max_consecutive_skips",
               "model.checkpoint_activations", "train.tensorboard", "train.engine", "train.heartbeat_timeout",
               "train.collective_timeout", "train.share_gpu", "train.cudnn_benchmark", "train.channels_last",
               "head.matmul", "train.allow_host_allreduce", "train.stragglers", "train.straggler_ratio",
               "train.straggler_steps", "train.straggler_min_nodes", "train.straggler_cooldown",
               "train.compile", "train.compile_mode", "train.compile_head", "train.skip_decision",
               "optim.backbone_kernel", "optim.classifier_kernel")
EXTEND_BEFORE = ("train.steps", "train.epochs")


def test_resume_policy_from_the_declarations_is_the_old_lists():
    """The keys a resume may change, read from each key's declaration, are the ones resume.py listed (order
    aside: resume matches by prefix), a section as one entry; resume uses exactly these."""
    from hvd_partialfc.config import opt, resume_policy
    from hvd_partialfc.run.ckpt.resume import RESUME_EXTEND_KEYS, RESUME_FREE_KEYS
    free, extend = resume_policy()
    assert len(free) == len(set(free)) and sorted(free) == sorted(FREE_BEFORE)
    assert extend == EXTEND_BEFORE
    assert (RESUME_FREE_KEYS, RESUME_EXTEND_KEYS) == (free, extend)
    with pytest.raises(ValueError, match="resume='fre'"):
        opt(0, "a key", resume="fre")
