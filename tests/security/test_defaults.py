"""Safe defaults (issue #42) that need no server: dependency pins and option defaults."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from agentrt.engine.args import EngineArgs
from agentrt.server.state import ServerConfig

ROOT = Path(__file__).resolve().parents[2]


def test_jinja2_is_pinned_past_its_sandbox_escapes() -> None:
    # Chat templates render in jinja2's sandbox: 3.1.5 and 3.1.6 fixed escapes from it.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [Requirement(r) for r in project["dependencies"] if re.match(r"jinja2\b", r)]
    assert not pin.specifier.contains("3.1.5") and pin.specifier.contains("3.1.6")
    import jinja2

    assert Version(jinja2.__version__) >= Version("3.1.6")


def test_option_defaults_are_the_safe_ones() -> None:
    args = EngineArgs()
    assert args.kv_storage_max_gb is not None  # a client cannot fill the disk
    config = ServerConfig()
    assert not config.allow_client_priority  # a client cannot jump the queue
    assert config.cache_isolation == "none"  # and a client's cache_salt is honoured
    assert "kv_secret" not in repr(EngineArgs(kv_secret="x" * 32))
