"""The one registry of named components (hvd_partialfc/registry.py) and the four kinds built on it."""
import pytest

from hvd_partialfc.registry import Registry


def test_a_name_is_registered_once_and_an_unknown_one_names_the_nearest():
    r = Registry("backbone")

    @r.register("iresnet50")
    def build():
        return "net"

    assert r.get("iresnet50") is build and r.names() == ["iresnet50"]
    r.add("iresnet100", object())
    with pytest.raises(ValueError, match=r"^backbone 'iresnet50' registered twice$"):
        r.add("iresnet50", object())
    with pytest.raises(ValueError) as e:
        r.get("iresnet5")
    assert str(e.value) == "unknown backbone 'iresnet5'; known: iresnet100, iresnet50; did you mean `iresnet50`?"


def test_order_key_and_hint_options():
    r = Registry("classifier mode", key="head.mode=", sort=False, suggest=False)
    r.add("local", 1)
    r.add("global", 2)
    assert r.names() == ["local", "global"]      # registration order: the first is the default
    with pytest.raises(ValueError) as e:
        r.get("locl")
    assert str(e.value) == "unknown classifier mode head.mode='locl'; known: local, global"


def test_the_four_registries_keep_their_messages():
    from data_tools.importers import get_importer
    from hvd_partialfc.classifier.margins import create_margin
    from hvd_partialfc.classifier.modes import get_mode
    from hvd_partialfc.models import create_model
    with pytest.raises(ValueError, match=r"^unknown backbone 'iresnet5'; known: .*; did you mean `iresnet50`\?$"):
        create_model("iresnet5")
    with pytest.raises(ValueError, match=r"^unknown loss 'arcfac'; known: arcface, cosface, softmax; did you mean "
                                         r"`arcface`\?$"):
        create_margin("arcfac")
    with pytest.raises(ValueError, match=r"^unknown classifier mode head.mode='locl'; known: local, global, "
                                         r"replicated; did you mean `local`\?$"):
        get_mode("locl")
    with pytest.raises(ValueError, match=r"^unknown source format 'npy'; known: fonts, imagefolder, list, npz, "
                                         r"recordio$"):
        get_importer("npy")
