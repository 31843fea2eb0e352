"""Refuse, before Hydra composes anything, what it would accept and then ignore.

Hydra lets ``+fusion.bucket_cap=3`` or ``+ckpt_path=x`` append keys that nothing reads, and its own
listing of a group's options includes the schema nodes (``schedule_schema``). Every key a command
line sets must be a field of the typed schema and every group choice one of the group's files;
the refusal names the key and what is valid there, in one line.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union, get_args, get_origin, get_type_hints

from commsched.errors import CommSchedConfigError, bad_value


def group_choices(conf_dir: Path) -> dict[str, tuple[str, ...]]:
    """The options of every config group: the YAML files of each folder of `conf_dir`."""
    return {d.name: tuple(sorted(f.stem for f in d.glob("*.yaml"))) for d in sorted(conf_dir.iterdir()) if d.is_dir()}


def _fields(schema: type) -> dict[str, Any]:
    hints = get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _checks(schema: type) -> dict[str, Any]:
    """The fields' own checks (`commsched.options.option`): a value Hydra cannot even parse is refused
    with the same words as one that parses but is out of range."""
    return {f.name: f.metadata["check"] for f in dataclasses.fields(schema) if "check" in f.metadata}


def _nested(annotation: Any) -> Optional[type]:
    """The dataclass a field holds, if it holds one."""
    return annotation if dataclasses.is_dataclass(annotation) else None


def check(argv: Sequence[str], schema: type, groups: dict[str, tuple[str, ...]]) -> None:
    """Raise `CommSchedConfigError` for the first override that names an unknown key or group option."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue  # Hydra's flags (-m, --cfg ...) and bare words are Hydra's business
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key == "hydra" or key.startswith("hydra."):
            continue
        if key in groups:
            for choice in value.split(","):  # a sweep: schedule=ddp,wfbp
                if choice not in groups[key]:
                    raise bad_value(key, choice, groups[key])
            continue
        node: Optional[type] = schema
        owner: type = schema
        path: list[str] = []
        for part in key.split("."):
            fields = _fields(node)
            if part not in fields:
                where = ".".join(path) or "the configuration"
                close = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.5)
                raise CommSchedConfigError(
                    f"commsched: unknown key {key!r}; valid keys in {where}: {', '.join(fields)}"
                    + (f"; groups: {', '.join(g + '=' for g in groups)}" if not path else "")
                    + "."
                    + (f" Fix: did you mean {'.'.join([*path, close[0]])}=...?" if close else "")
                )
            path.append(part)
            owner, node = node, _nested(fields[part])
            if node is None and part != key.split(".")[-1]:
                raise CommSchedConfigError(f"commsched: unknown key {key!r}: {'.'.join(path)} has no sub-keys.")
        if node is None and not arg.startswith("~"):
            last = key.split(".")[-1]
            _check_value(key, value, fields[last], _checks(owner).get(last))


_TRUTH = {"true", "false", "yes", "no", "on", "off"}
_KINDS = {int: "an integer", float: "a number", bool: "true or false"}


def _parses(text: str, kind: type) -> bool:
    if kind is bool:
        return text.lower() in _TRUTH
    try:
        kind(text)
        return True
    except ValueError:
        return False


def _check_value(key: str, value: str, annotation: Any, check: Optional[Callable[[str, Any], Any]]) -> None:
    """Refuse a value Hydra could not convert to the field's type (it would answer with a stack of
    its own lines), in the field's own words when it has a check; sweeps (`a,b`), sweep functions
    and interpolations are Hydra's to read."""
    optional = get_origin(annotation) is Union and type(None) in get_args(annotation)
    kind = next((a for a in get_args(annotation) if a is not type(None)), None) if optional else annotation
    if kind not in _KINDS or "(" in value or "${" in value:
        return
    for choice in value.split(","):
        if optional and choice == "null":
            continue
        if not _parses(choice, kind):
            if check is not None:
                check(key, choice)  # refuses a string wherever a number or a flag is expected
            allowed = _KINDS[kind] + (" or null" if optional else "")
            raise bad_value(key, choice, allowed)


def print_help(
    about: str, program: str, conf_dir: Path, config_name: str, groups: dict[str, Sequence[str]], argv: Sequence[str]
) -> None:
    """`about` (what the command does, first), the config groups and their options, and the config
    the command line composes, as Hydra's ``--help`` lays them out. Hydra's own help lists each
    group's options by copying its whole config repository once per group (1.5-3 s here) and lists
    the typed schema nodes (``data_schema``) among them; the groups' files say the same at once."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(version_base=None, config_dir=str(conf_dir)):
        cfg = compose(config_name, overrides=[a for a in argv if "=" in a and not a.startswith("-")])
    listed = "".join(f"{group}: {', '.join(sorted(options))}\n" for group, options in sorted(groups.items()))
    print(
        f"{about.rstrip()}\n\n{program} is powered by Hydra.\n\n== Configuration groups ==\n"
        f"Compose your configuration from those groups (group=option)\n\n{listed}\n\n== Config ==\n"
        f"Override anything in the config (foo.bar=value)\n\n{OmegaConf.to_yaml(cfg)}\n"
        "Powered by Hydra (https://hydra.cc)\nUse --hydra-help to view Hydra specific help\n"
    )
