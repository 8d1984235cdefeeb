"""Loading a plan: the YAML file (or the shipped default), then TFQ_* environment variables, then --set.

Each later step overrides the one before and is remembered as the key's source, so plan lines and errors
name what set a value (`(set by TFQ_KV_PAGES)`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from tfq.plan.fields import Bad, flag
from tfq.plan.schema import (
    ENV_FLAGS,
    ENV_VALUES,
    SCHEMA,
    KVPlan,
    Plan,
    override,
    unknown_key,
)
from tfq.plan.words import fail


def _flatten(doc: Any, where: str) -> dict[str, Any]:
    """A YAML document as {dotted key: value}; an unknown key is an error that suggests the nearest."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise fail(f"{where}: a plan is a YAML mapping of keys (window: 4096, lanes: 8, ...), not {type(doc).__name__}")
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        if key == "kv":
            if value is None:
                continue
            if not isinstance(value, dict):
                raise fail(f"{where}: kv must be a mapping (dtype, pages, paged, pool), not {value!r}")
            for sub, subvalue in value.items():
                dotted = f"kv.{sub}"
                if dotted not in SCHEMA:
                    raise fail(f"{where}: {unknown_key(dotted)}")
                flat[dotted] = subvalue
        elif isinstance(key, str) and key in SCHEMA:
            flat[key] = value
        else:
            raise fail(f"{where}: {unknown_key(str(key))}")
    return flat


def parse_plan_text(text: str, where: str = "plan") -> Plan:
    """A plan from YAML text alone (no overrides); `where` names it in errors."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise fail(f"{where}: not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise fail(f"{where}: not valid YAML: nested too deeply") from None
    kv: dict[str, Any] = {}
    top: dict[str, Any] = {}
    named: list[str] = []
    for key, value in _flatten(doc, where).items():
        if value is None:  # `window:` with no value keeps the default
            continue
        named.append(key)
        try:
            checked = SCHEMA[key](value)
        except Bad as e:
            raise fail(f"{where}: {e}") from None
        if key.startswith("kv."):
            kv[key[3:]] = checked
        else:
            top[key] = checked
    return Plan(**top, kv=KVPlan(**kv), named=tuple(named))


def load_plan(path: str | Path | None, env: Mapping[str, str] = os.environ, sets: Sequence[str] = ()) -> Plan:
    """The plan file (None: the shipped default), then TFQ_* variables from `env`, then `key=value` sets."""
    if path is None:
        plan = Plan()
    else:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise fail(f"plan file {str(path)!r} not found; give a plan YAML (plans/ holds examples)") from None
        except UnicodeDecodeError:
            raise fail(f"{str(path)!r}: not a text file; a plan is YAML") from None
        except OSError as e:
            raise fail(f"plan file {str(path)!r}: cannot read it ({e.strerror or e})") from None
        plan = parse_plan_text(text, str(path))
    return apply_sets(apply_env(plan, env), sets)


def apply_env(plan: Plan, env: Mapping[str, str]) -> Plan:
    for var, key in ENV_VALUES.items():
        text = env.get(var)
        if text is not None and text.strip():  # an empty variable counts as unset
            plan = override(plan, key, text, var, f"{var}={text}")
    for var, (key, value, what) in ENV_FLAGS.items():
        text = env.get(var)
        if text is None:
            continue
        try:
            on = flag(text)
        except Bad:
            raise fail(f"{var}={text}: use {var}=1 to {what}, or 0 (or unset) to leave the plan alone") from None
        if on:
            plan = override(plan, key, value, var, f"{var}={text}")
    return plan


def apply_sets(plan: Plan, sets: Sequence[str]) -> Plan:
    for item in sets:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise fail(f"--set {item}: write --set key=value, e.g. --set kv.pages=256")
        if key == "kv":
            raise fail(f"--set {item}: kv is a section; set kv.dtype, kv.pages, kv.paged or kv.pool")
        plan = override(plan, key, value, "--set", f"--set {item}")
    return plan
