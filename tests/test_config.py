"""One config object: YAML + --set overrides; unknown keys and wrong types are errors."""
import pytest

from hvd_partialfc.config import ConfigError, diff_configs, dump_config, load_config


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
