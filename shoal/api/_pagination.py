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
             after: str | None = None, before: str | None = None,
             order_of: Callable[[T], tuple] | None = None,
             deleted: Callable[[str], tuple | None] | None = None,
             descending: bool = False) -> Page[T]:
    """A page of ``items``. A cursor naming an item deleted since it was handed
    out (a client deleting each item of a page, then asking for the next) is
    placed where that item stood, by its place in the order (``order_of`` of
    the items, ``deleted`` of the cursor; ``descending`` if the items run
    backwards), as long as the deletion is remembered."""
    ids = [id_of(item) for item in items]
    if after is not None and before is not None:
        raise BadRequest(400, "give after_id or before_id, not both")

    def position(cursor: str, word: str) -> tuple[int, bool]:
        """The index of the cursor, or where it stood (and False)."""
        if cursor in ids:
            return ids.index(cursor), True
        place = deleted(cursor) if deleted is not None and order_of is not None else None
        if place is None:
            raise BadRequest(400, f"no item {cursor!r} to page {word}")
        return sum(1 for item in items
                   if (order_of(item) > place if descending else order_of(item) < place)), False

    if after is not None:
        index, found = position(after, "after")
        start = index + 1 if found else index
        chosen = items[start:start + limit]
        return Page(list(chosen), start + limit < len(items))
    if before is not None:
        end, _ = position(before, "before")
        start = max(0, end - limit)
        return Page(list(items[start:end]), start > 0)
    return Page(list(items[:limit]), limit < len(items))
