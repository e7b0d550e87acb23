"""Configuration in one place: every setting is a flag and a TOKENQ_* variable, --help shows the
defaults in force, and the README's table is generated from :class:`common.settings.Settings`.

    .venv/bin/python tests/test_settings.py --write    # regenerate the README's settings table
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.settings import Settings  # noqa: E402

README = ROOT / "README.md"
BEGIN, END = "<!-- settings-table -->", "<!-- /settings-table -->"


# ---------------------------------------------------------------------------- the parsers


def worker_parser() -> argparse.ArgumentParser:
    from worker.main import parser

    return parser()


def tokenq_subparsers() -> dict[str, argparse.ArgumentParser]:
    from producer.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("tokenq has no subcommands")


def options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> action of every --option (not --help, not positionals)."""
    return {a.dest: a for a in p._actions if a.option_strings and a.dest != "help"}


def used_by() -> dict[str, list[str]]:
    """For each setting, the commands whose flags set it."""
    out: dict[str, list[str]] = {f.name: [] for f in fields(Settings)}
    for dest in options(worker_parser()):
        out[dest].append("tokenq-worker")
    subs = tokenq_subparsers()
    for dest in out:
        have = [name for name, sp in subs.items() if dest in options(sp) and Settings.env_name(dest) in sp.format_help()]
        if len(have) == len(subs):
            out[dest].append("tokenq (all commands)")
        else:
            out[dest].extend(f"tokenq {name}" for name in have)
    return out


# ---------------------------------------------------------------------------- the README table


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(value: object) -> str:
    if value == "":
        return '`""`'
    return f"`{value}`"


def settings_table() -> str:
    """The markdown table of every setting, from Settings itself."""
    users = used_by()
    rows = ["| flag | environment variable | default | used by | what |", "|---|---|---|---|---|"]
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        what = f.metadata["help"]
        if f.metadata.get("choices"):
            what += f" (one of: {', '.join(f.metadata['choices'])})"
        rows.append(f"| `{flag}` | `{Settings.env_name(f.name)}` | {_default(f.default)} | "
                    f"{', '.join(users[f.name])} | {_cell(what)} |")
    return "\n".join(rows)


def readme_table(text: str) -> str:
    assert BEGIN in text and END in text, f"the README has no {BEGIN} ... {END} section"
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def write_readme() -> None:
    text = README.read_text()
    readme_table(text)
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{BEGIN}\n{settings_table()}\n{END}{tail}")


# ---------------------------------------------------------------------------- tests


def test_readme_table_is_generated_from_settings():
    assert readme_table(README.read_text()) == settings_table(), (
        "the README's settings table is out of date: run `.venv/bin/python tests/test_settings.py --write`")


def test_the_important_settings_are_in_the_table():
    table = readme_table(README.read_text())
    for env in ("TOKENQ_PAGE_SIZE", "TOKENQ_NUM_PAGES", "TOKENQ_KV_CACHE_MEMORY", "TOKENQ_MAX_NUM_SEQS",
                "TOKENQ_MAX_NUM_BATCHED_TOKENS", "TOKENQ_ADMISSION_POLICY", "TOKENQ_PREEMPTION_MODE",
                "TOKENQ_SOFT_LIMIT", "TOKENQ_CLAIM_IDLE_S", "TOKENQ_RESULT_TTL_S", "TOKENQ_REDIS_URL", "TOKENQ_PREFIX"):
        assert f"`{env}`" in table


def test_every_setting_is_a_flag_somewhere_and_documented():
    users = used_by()
    for f in fields(Settings):
        assert f.metadata.get("help"), f"{f.name} has no help text"
        assert users[f.name], f"{f.name} is not a flag of tokenq-worker or tokenq"


def test_every_worker_flag_is_a_setting_with_its_variable_and_default_in_help():
    p = worker_parser()
    text = p.format_help()
    names = {f.name for f in fields(Settings)}
    for dest, action in options(p).items():
        assert dest in names, f"tokenq-worker --{dest.replace('_', '-')} has no TOKENQ_* variable (not a Setting)"
        assert action.default is None  # so the environment, then the dataclass default, apply
    for dest in options(p):
        assert re.search(rf"\[env\s+{Settings.env_name(dest)};\s+default:", text), dest


def test_tokenq_connection_and_gateway_flags_show_their_variables_and_defaults():
    subs = tokenq_subparsers()
    assert {"submit", "status", "cancel", "gateway"} <= set(subs)
    for name, sp in subs.items():
        text = re.sub(r"\s+", " ", sp.format_help())
        for dest in ("redis_url", "prefix"):
            assert re.search(rf"\[env {Settings.env_name(dest)}; default: '", text), f"tokenq {name} --{dest}"
    gw = re.sub(r"\s+", " ", subs["gateway"].format_help())
    for dest in ("host", "port", "api_key", "model_name"):
        assert f"[env {Settings.env_name(dest)}; default:" in gw


def test_help_of_the_installed_commands(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TOKENQ_")}, "TOKENQ_PAGE_SIZE": "32",
           "TOKENQ_API_KEY": "s3cret", "TOKENQ_REDIS_URL": "redis://app:hunter2@redis.example:6379/0"}
    w = subprocess.run([sys.executable, "-m", "worker.main", "--help"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=60)
    assert w.returncode == 0, w.stderr
    flat = re.sub(r"\s+", " ", w.stdout)
    assert "[env TOKENQ_PAGE_SIZE; default: 32]" in flat  # the default in force, from the environment
    assert "[env TOKENQ_ADMISSION_POLICY; default: 'optimistic']" in flat
    assert "hunter2" not in flat and "'redis://app:***@redis.example:6379/0'" in flat
    t = subprocess.run([sys.executable, "-m", "producer.cli", "gateway", "--help"], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=60)
    assert t.returncode == 0, t.stderr
    flat = re.sub(r"\s+", " ", t.stdout)
    assert "[env TOKENQ_PORT; default: 8000]" in flat
    assert "s3cret" not in flat and "[env TOKENQ_API_KEY; default: '***']" in flat
    top = subprocess.run([sys.executable, "-m", "producer.cli", "--help"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=60)
    assert top.returncode == 0 and "gateway" in top.stdout and "submit" in top.stdout


def test_environment_then_flag():
    env = {"TOKENQ_MAX_NUM_SEQS": "7", "TOKENQ_SOFT_LIMIT": "0.5", "TOKENQ_ADMISSION_POLICY": "Reserve",
           "TOKENQ_LOG_LEVEL": "DEBUG", "TOKENQ_PREFIX": "p1"}
    s = Settings.from_env(env)
    assert (s.max_num_seqs, s.soft_limit, s.admission_policy, s.log_level, s.prefix) == (7, 0.5, "reserve", "debug", "p1")
    assert Settings.from_env(env, max_num_seqs=9).max_num_seqs == 9  # a flag wins
    assert Settings.from_env({}).max_num_seqs == 64
    with pytest.raises(ValueError, match="TOKENQ_MAX_NUM_SEQS"):
        Settings.from_env({"TOKENQ_MAX_NUM_SEQS": "many"})
    with pytest.raises(ValueError, match="TOKENQ_PREEMPTION_MODE must be one of"):
        Settings.from_env({"TOKENQ_PREEMPTION_MODE": "drop"})


def test_every_setting_round_trips_through_its_variable():
    samples = {int: "3", float: "0.25", str: "x"}
    for f in fields(Settings):
        raw = f.metadata["choices"][-1] if f.metadata.get("choices") else samples[type(f.default)]
        got = getattr(Settings.from_env({Settings.env_name(f.name): raw}), f.name)
        assert got == type(f.default)(raw), f.name


def test_worker_bad_environment_is_a_clear_error():
    env = {**os.environ, "TOKENQ_PAGE_SIZE": "sixteen"}
    p = subprocess.run([sys.executable, "-m", "worker.main"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=60)
    assert p.returncode == 2 and "TOKENQ_PAGE_SIZE='sixteen' is not a valid int" in p.stderr


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_readme()
        print(f"wrote the settings table into {README}")
    else:
        print(settings_table())
