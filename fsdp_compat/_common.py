"""Names and small shared pieces used across the package."""

from __future__ import annotations

import enum
import os
import sys
import warnings
from typing import NoReturn

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"
CHECKPOINT_PREFIX = CHECKPOINT_WRAPPED_MODULE + "."


class InteroperableEnum(enum.Enum):
    """An enum whose members equal torch FSDP1's members of the same class and member name (ours outlive
    FSDP1; code comparing a wrapper's attributes with torch's enums keeps working)."""

    def __eq__(self, other: object) -> bool:
        # Members of one class are singletons: identity answers for them without the name comparison
        # (state-dict and runtime code compare a unit's state and strategy per entry).
        if type(other) is type(self):
            return other is self
        if isinstance(other, enum.Enum):
            return type(other).__name__ == type(self).__name__ and other.name == self.name
        return NotImplemented

    def __hash__(self) -> int:
        # Enum hashes members by name; hashing the same way lets torch's members find ours in dicts.
        return hash(self._name_)


class TrainingState(InteroperableEnum):
    """What a wrapper is doing now (FSDP1's ``training_state``, equal to its members); FSDP1 uses these to
    reject calls at the wrong moment."""

    IDLE = enum.auto()
    FORWARD_BACKWARD = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


def clean_name(name: str) -> str:
    """An FQN without the wrapper prefixes: what FSDP1 puts in state dicts and optimizer states."""
    return name.replace(FSDP_PREFIX, "").replace(CHECKPOINT_PREFIX, "")


def clean_module_path(path: str) -> str:
    """A module path (``named_modules``) without the wrapper segments."""
    return ".".join(s for s in path.split(".") if s not in (FSDP_WRAPPED_MODULE, CHECKPOINT_WRAPPED_MODULE))


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Warn (``UserWarning``) once per process for ``key``: FSDP1 options the engine makes moot."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def forget_warnings() -> None:
    """Let every :func:`warn_once` warning be given again (a new test, as in a new process)."""
    _warned.clear()


def exit_without_finalizing(code: int = 0) -> NoReturn:
    """End this process now, its output flushed, without shutting the interpreter down: for a rank
    whose work is done and written. torch keeps a gloo process group's worker threads alive past
    ``destroy_process_group()``, and one that releases a finished collective's tensors while the
    interpreter shuts down cannot take the GIL and aborts the process ("terminate called without an
    active exception"), which would turn a good run into a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
