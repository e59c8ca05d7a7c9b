"""Why a site is left alone, as a value: a kind (a stable code and its wording)
and the facts it names (the culprit equation's primitive and the numbers).

The module that decides declares each kind once, beside the rule it states:

    SECOND_READER = ReasonKind("second-reader",
                               "the `{culprit}` result has {uses} uses; {outside} outside the fused region",
                               blame="readers")
    ...
    return SECOND_READER("add", uses=2, outside=1)

The text is rendered from the kind's template (`str(reason)`); `explain`'s
table prints it, and pictures, tests and tools read the structure: `code`,
`culprit`, `numbers` and `blame` (which edges of the program caused it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def human_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB'; binary units."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.3g} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"  # pragma: no cover


class Bytes(int):
    """A byte count a reason names; rendered in binary units ('1.5 MiB')."""

    def __format__(self, spec: str) -> str:
        return human_bytes(int(self)) if not spec else format(int(self), spec)


BLAMES = ("readers", "producer")


@dataclasses.dataclass(frozen=True)
class ReasonKind:
    """One kind of decline: its stable `code`, the `template` its text is
    rendered from (`str.format` over `culprit` and the reason's numbers), and
    what it blames in the program: "readers" (the culprit's value is read
    outside the site), "producer" (the culprit computes one of the site's
    operands) or None (nothing one edge shows)."""

    code: str
    template: str
    blame: str | None = None

    def __post_init__(self):
        if self.blame is not None and self.blame not in BLAMES:
            raise ValueError(f"blame must be one of {BLAMES} or None, got {self.blame!r}")

    def __call__(self, culprit: str | None = None, **numbers) -> "Reason":
        return Reason(self, culprit, tuple(sorted(numbers.items())))


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why a site was declined: a `ReasonKind` and the facts it names."""

    kind: ReasonKind
    culprit: str | None = None
    """The primitive name of the equation at fault, where there is one."""
    items: tuple = ()
    """The numbers (and words) the text names, as sorted (name, value) pairs."""

    @property
    def code(self) -> str:
        return self.kind.code

    @property
    def blame(self) -> str | None:
        return self.kind.blame

    @property
    def numbers(self) -> Mapping[str, Any]:
        return dict(self.items)

    def __str__(self) -> str:
        return self.kind.template.format(culprit=self.culprit, **self.numbers)

    def __repr__(self) -> str:
        facts = ", ".join(f"{k}={v!r}" for k, v in self.items)
        culprit = f", culprit={self.culprit!r}" if self.culprit is not None else ""
        return f"Reason({self.code!r}{culprit}{', ' + facts if facts else ''})"

    def startswith(self, prefix: str) -> bool:  # reads like the text it renders
        return str(self).startswith(prefix)

    def __format__(self, spec: str) -> str:  # in a table's column, as its text
        return format(str(self), spec)

    def __contains__(self, text: str) -> bool:  # `"..." in reason`, as in its text
        return text in str(self)


# A reason whose words come whole from elsewhere: a check's own message, an
# exception, a user predicate. Its code says where.
def message(code: str) -> ReasonKind:
    """A kind whose text is its `text` number as given."""
    return ReasonKind(code, "{text}")


def as_reason(why, code: str = "message") -> Reason | None:
    """`why` as a Reason (a string becomes a `message` reason of `code`)."""
    if why is None or isinstance(why, Reason):
        return why
    return message(code)(text=str(why))
