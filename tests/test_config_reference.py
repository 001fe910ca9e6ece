"""docs/CONFIGURATION.md is generated from the config dataclasses (through the CLI's parser) and
kept in step with them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "config_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_is_current() -> None:
    generator = _generator()
    assert generator.PAGE.read_text() == generator.render(), \
        "docs/CONFIGURATION.md is stale: run python scripts/config_reference.py"


def test_every_knob_of_the_configs_is_on_the_page() -> None:
    """Each dataclass field with help (a `knob`) that one of the commands exposes is in the page."""
    import dataclasses

    from pdserve.config import EngineArgs
    from pdserve.config_flags import flag_name
    from pdserve.disagg.config import RouterConfig, WorkerConfig
    from pdserve.serving.config import ApiConfig

    page = _generator().render()
    for cls in (EngineArgs, RouterConfig, WorkerConfig, ApiConfig):
        for field in dataclasses.fields(cls):
            if field.metadata.get("help"):
                assert f"`{flag_name(field.name)}`" in page, (cls.__name__, field.name)


def test_a_changed_help_makes_the_page_stale(tmp_path: Path, monkeypatch) -> None:
    generator = _generator()
    page = tmp_path / "CONFIGURATION.md"
    page.write_text(generator.render().replace("tokens per KV block", "tokens per block"))
    monkeypatch.setattr(generator, "PAGE", page)
    assert generator.main(["--check"]) == 1
    page.write_text(generator.render())
    assert generator.main(["--check"]) == 0
