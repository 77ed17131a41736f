"""``make install``'s uv is told pip's own configuration (tools/uv_flags.py): the same indexes, find-links and
constraints, pip's precedence where a setting is given twice."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "uv_flags.py"


def _uv_flags():
    spec = importlib.util.spec_from_file_location("uv_flags", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.uv_flags


def test_pip_settings_become_uv_flags_in_pips_order_of_precedence():
    listed = "\n".join([
        "global.find-links='/machine'", "global.constraint='/etc/c.txt'", "global.cert='/etc/ca.crt'",
        "global.extra-index-url='file:///a/simple file:///b/simple'", "user.index-url='https://user/simple'",
        "site.index-url='https://venv/simple'", ":env:.find-links='/from/env'", ":env:.default-timeout='180'"])
    assert _uv_flags()(listed) == [
        "--find-links", "/from/env",  # PIP_FIND_LINKS beats the machine's file
        "--index-url", "https://venv/simple",  # the virtual environment's file beats the user's
        "--constraint", "/etc/c.txt",
        "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple"]
    assert _uv_flags()("") == []
