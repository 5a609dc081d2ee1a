"""Cursor pagination over an ordered list, as the Files and Containers APIs page.

Both dialects page by an item's id: ``after`` an id (the next page), or
``before`` one (the previous page), ``limit`` items at a time, with
``has_more`` saying whether more lie in the direction of travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from .errors import BadRequest

T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    has_more: bool


def check_limit(limit: int, highest: int) -> int:
    if not 1 <= limit <= highest:
        raise BadRequest(400, f"limit must be between 1 and {highest}")
    return limit


def paginate(items: Sequence[T], id_of: Callable[[T], str], limit: int,
             after: str | None = None, before: str | None = None) -> Page[T]:
    ids = [id_of(item) for item in items]
    if after is not None and before is not None:
        raise BadRequest(400, "give after_id or before_id, not both")
    if after is not None:
        if after not in ids:
            raise BadRequest(400, f"no item {after!r} to page after")
        start = ids.index(after) + 1
        chosen = items[start:start + limit]
        return Page(list(chosen), start + limit < len(items))
    if before is not None:
        if before not in ids:
            raise BadRequest(400, f"no item {before!r} to page before")
        end = ids.index(before)
        start = max(0, end - limit)
        return Page(list(items[start:end]), start > 0)
    return Page(list(items[:limit]), limit < len(items))
