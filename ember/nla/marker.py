"""The marker: the one prompt token whose input embedding the activation vector replaces.

The marker is the first character of `MARKER_CANDIDATES` (the NLA fork's list of rare
characters, in its order) that the tokenizer keeps as exactly one token, also inside
`<concept>…</concept>`, and decodes back; or the character `injection_token` names, checked
the same way. The one thing to know: the fork derives the marker from the tokenizer in every
component and stores it nowhere, so a data file and a model with another tokenizer disagree
silently; ember records the marker and its id in every parquet file it writes
(`marker_metadata`) and checks them against the tokenizer when the file is read
(`check_recorded_marker`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from ember.config.errors import ConfigError
from ember.data.parquet import DatasetError, read_parquet_metadata

# The NLA fork's candidates: circled ideographs, then rare CJK characters.
MARKER_CANDIDATES = (
    "㊗", "㊙", "㊚", "㊛", "㊜", "㊝", "㊞", "㊟", "㊠", "㊡", "㊢", "㊣", "㊤", "㊥", "㊦", "㊧", "㊨", "㊩", "㊪", "㊫",
    "㊬", "㊭", "㊮", "㊯", "㊰", "囍", "囧", "囪", "囫", "囬", "囮", "囯", "囱", "囲", "図", "囶", "囷", "囸", "囹", "囻",
)
MARKER_METADATA_KEY = "ember.nla.marker"


@dataclass(frozen=True)
class Marker:
    """The marker character and its token id under one tokenizer."""

    character: str
    token_id: int

    @property
    def concept(self) -> str:
        """The marker as prompts carry it: `<concept>MARKER</concept>`."""
        return concept_text(self.character)


def concept_text(character: str) -> str:
    return f"<concept>{character}</concept>"


def marker_problem(tokenizer: PreTrainedTokenizerBase, character: str) -> str | None:
    """Why `character` cannot be the marker under `tokenizer`, or None when it can (the fork's four tests)."""
    ids = tokenizer.encode(character, add_special_tokens=False)
    if len(ids) != 1:
        return f"it encodes to {len(ids)} tokens {ids}, not one"
    token_id, tagged = ids[0], concept_text(character)
    tagged_ids = tokenizer.encode(tagged, add_special_tokens=False)
    if tagged_ids.count(token_id) != 1:
        return f"inside {tagged} its token {token_id} does not appear exactly once ({tagged_ids})"
    if tokenizer.decode(tagged_ids) != tagged:
        return f"{tagged} decodes back as {tokenizer.decode(tagged_ids)!r}"
    if tokenizer.decode([token_id]) != character:
        return f"its token {token_id} decodes as {tokenizer.decode([token_id])!r}"
    return None


def choose_marker(tokenizer: PreTrainedTokenizerBase, requested: str | None = None,
                  key: str = "nla.injection.injection_token") -> Marker:
    """The marker under `tokenizer`: `requested` if given (it must pass the tests), else the first candidate
    that does. `key` is the configuration key that names a requested marker, for the messages."""
    name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    if requested is not None:
        problem = marker_problem(tokenizer, requested)
        if problem is not None:
            raise ConfigError(f"{key}={requested!r} cannot be the marker with tokenizer {name}: {problem}; "
                              "choose a character it keeps as one token, or null to let ember choose")
        return Marker(requested, tokenizer.encode(requested, add_special_tokens=False)[0])
    for character in MARKER_CANDIDATES:
        if marker_problem(tokenizer, character) is None:
            return Marker(character, tokenizer.encode(character, add_special_tokens=False)[0])
    raise ConfigError(f"tokenizer {name} keeps none of the {len(MARKER_CANDIDATES)} marker candidates "
                      f"({''.join(MARKER_CANDIDATES)}) as one token; set {key} to a character it does")


def marker_metadata(marker: Marker) -> dict[str, str]:
    """The parquet metadata that records `marker` with the rows written for it."""
    return {MARKER_METADATA_KEY: json.dumps({"character": marker.character, "token_id": marker.token_id})}


def recorded_marker(path: str) -> Marker | None:
    """The marker recorded in the parquet file at `path`, or None for a file written without one (the fork's)."""
    recorded = read_parquet_metadata(path).get(MARKER_METADATA_KEY)
    if recorded is None:
        return None
    try:
        value = json.loads(recorded)
        return Marker(str(value["character"]), int(value["token_id"]))
    except (ValueError, KeyError, TypeError):
        raise DatasetError(f"{path}: its {MARKER_METADATA_KEY} metadata {recorded!r} is not "
                           '{"character": ..., "token_id": ...}; write the file again') from None


def check_recorded_marker(path: str, marker: Marker) -> None:
    """Stop when the file at `path` was written for another marker than the tokenizer's."""
    recorded = recorded_marker(path)
    if recorded is not None and recorded != marker:
        raise DatasetError(f"{path} was written with marker {recorded.character!r} (token id {recorded.token_id}), but "
                           f"the tokenizer now gives {marker.character!r} (token id {marker.token_id}): the data was "
                           "made for another tokenizer or injection_token; extract it again with this one, or set "
                           f"the injection_token to {recorded.character!r} if the tokenizer keeps it as one token")
