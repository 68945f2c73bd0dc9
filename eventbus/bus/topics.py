"""Topics and subscription groups: what a subscriber subscribes to, and how it knows it missed nothing.

Every message has a *topic*, one byte on the wire: its index in :data:`TOPICS` (its kind, or its
event; a checkpoint event that carries a staged checkpoint, the event's :data:`STAGED_TOPICS` topic).
On the PUB socket a window goes out under :func:`subscription` of a set of topics (one subscription
group's windows: the bus thread sends each group a window holding its topics only) or under
:data:`WINDOW_TOPIC` (windows for every subscriber). Per topic, the trainer keeps its latest seq
(*links*, :func:`previous_of`): a subscriber asks how far the run is and compares its own topics'.
"""

from __future__ import annotations

from typing import Iterable, Optional

from eventbus.bus.schema import Kind
from eventbus.core.events import Event

__all__ = ["WINDOW_TOPIC", "GROUP_TOPIC", "STAGED_TOPICS", "TOPICS", "TOPIC_MESSAGES", "LINKS_BYTES", "MASK_BYTES",
           "topic_index", "topic_message", "previous_of", "subscription", "group_table"]

WINDOW_TOPIC = b"wa"  # windows for every subscriber (each subscribes to it besides its group)
GROUP_TOPIC = b"wg"  # + a topic mask: one subscription group's windows

#: Per checkpoint event, the topic of its messages that carry a staged checkpoint (payload key
#: ``checkpoint``): BATCH_CHECKPOINT fires every batch, and a subscriber that acts only on staged
#: checkpoints (the checkpoint worker) subscribes to this topic alone, so the others never wake it.
#: FIT_END keeps one topic: its subscribers want it whatever it carries.
STAGED_TOPICS: dict[str, str] = {event.value: f"staged_{event.value}" for event in
                                 (Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT, Event.ITERATION_CHECKPOINT)}
_KINDS = (Kind.HEADER, Kind.METRICS, Kind.END)
# The message kinds that are not events, the 40 events in Composer's order, then the staged
# checkpoints'. New topics go at the end: a journal's topic bytes keep their meaning.
TOPICS: tuple[str, ...] = (*_KINDS, *(e.value for e in Event), *STAGED_TOPICS.values())
_TOPIC_INDEX = {name: i for i, name in enumerate(TOPICS)}
_STAGED_EVENT = {topic: event for event, topic in STAGED_TOPICS.items()}
#: Per topic index, the (kind, event) of its messages (a staged checkpoint's: its event).
TOPIC_MESSAGES: tuple[tuple[str, Optional[str]], ...] = tuple(
    (name, None) if name in _KINDS else (Kind.EVENT, _STAGED_EVENT.get(name, name)) for name in TOPICS)
LINKS_BYTES = 4 * len(TOPICS)
MASK_BYTES = (len(TOPICS) + 7) // 8


def topic_index(kind: str, event: Optional[str], staged: bool = False) -> int:
    """The topic of a message: its event (``staged``: its payload carries a staged checkpoint, the
    event's :data:`STAGED_TOPICS` topic if it has one), or its kind for header / metrics / end."""
    if kind != Kind.EVENT or event is None:
        return _TOPIC_INDEX[kind]
    return _TOPIC_INDEX[STAGED_TOPICS.get(event, event) if staged else event]


def topic_message(topic: int) -> tuple[str, Optional[str]]:
    """The (kind, event) of the messages of a topic index."""
    return TOPIC_MESSAGES[topic]


def previous_of(links: bytes, topics: Iterable[int]) -> int:
    """The latest seq, before this message, of any of ``topics``; -1 when the links are missing."""
    if len(links) != LINKS_BYTES:
        return -1
    seqs = memoryview(links).cast("I")
    return max((seqs[i] for i in topics), default=0)


def subscription(topics: Optional[Iterable[int]]) -> bytes:
    """The PUB topic of the group of subscribers of ``topics`` (indices; None: all of them)."""
    mask = bytearray(MASK_BYTES)
    for i in range(len(TOPICS)) if topics is None else topics:
        mask[i >> 3] |= 1 << (i & 7)
    return GROUP_TOPIC + bytes(mask)


def group_table(topic: bytes) -> Optional[bytes]:
    """For a group's PUB topic, a table for ``bytes.translate``: 1 at each topic index of the
    group, 0 elsewhere; None for any other topic."""
    if len(topic) != len(GROUP_TOPIC) + MASK_BYTES or not topic.startswith(GROUP_TOPIC):
        return None
    mask = topic[len(GROUP_TOPIC):]
    return bytes((mask[i >> 3] >> (i & 7)) & 1 if i < len(TOPICS) else 0 for i in range(256))
