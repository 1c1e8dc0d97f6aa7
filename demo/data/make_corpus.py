"""Write corpus.txt: about 200 KB of English-like tales from a small seeded grammar.

We generate the corpus instead of downloading one so the demo runs offline and the file's
origin is plain: this script, a fixed seed, and word lists written for it. Run it again and
you get the same bytes (``python demo/data/make_corpus.py`` rewrites corpus.txt).
"""

from __future__ import annotations

import random
from pathlib import Path

SEED = 1234
TARGET_BYTES = 200_000

PEOPLE = ["the old sailor", "the miller", "a young weaver", "the keeper of the light", "my grandmother",
          "the smith", "a tired soldier", "the baker's daughter", "the ferryman", "a quiet monk",
          "the shepherd", "the widow Marsh", "Captain Hale", "little Tom", "the schoolmaster"]
PLACES = ["the harbor", "the mill", "the north road", "the chapel", "the market square", "the forest",
          "the river bank", "the high meadow", "the inn", "the lighthouse", "the orchard", "the bridge"]
THINGS = ["a grey ship", "a lantern", "an iron key", "a letter", "a loaf of bread", "a red fox",
          "a broken wheel", "a silver coin", "an old map", "a basket of apples", "a bell", "a storm"]
VERBS = ["walked to", "ran toward", "came back from", "waited by", "looked across", "slept near",
         "sang at", "searched", "left", "remembered"]
SEES = ["saw", "found", "carried", "lost", "mended", "sold", "hid", "followed", "counted", "watched"]
HAD = ["seen", "found", "carried", "lost", "mended", "sold", "hidden", "followed", "counted", "watched"]
TIMES = ["In the morning", "At dusk", "Before the rain", "Late that winter", "On the third day",
         "When the tide turned", "After supper", "Long ago", "At first light", "That evening"]
FEELINGS = ["glad", "afraid", "weary", "certain", "sorry", "curious", "silent", "hungry", "proud"]
SAYINGS = ["Nothing is lost that is remembered", "The sea keeps its own counsel",
           "Bread first, then stories", "Every road turns home at last",
           "A light in the window is worth a fire on the hill", "Count twice and sail once"]


def capitalized(text: str) -> str:
    return text[0].upper() + text[1:]  # str.capitalize would lowercase "Captain Hale"


def sentence(rng: random.Random) -> str:
    who, where, what = rng.choice(PEOPLE), rng.choice(PLACES), rng.choice(THINGS)
    forms = [
        lambda: f"{rng.choice(TIMES)}, {who} {rng.choice(VERBS)} {where}.",
        lambda: f"{capitalized(who)} {rng.choice(SEES)} {what} at {where}.",
        lambda: f"{capitalized(who)} was {rng.choice(FEELINGS)}, for {rng.choice(PEOPLE)} had {rng.choice(HAD)} {what}.",
        lambda: f"\"Where is {what}?\" asked {who}.",
        lambda: f"\"{rng.choice(SAYINGS)},\" said {who}.",
        lambda: f"There were {rng.randint(2, 12)} {rng.choice(['boats', 'geese', 'candles', 'men', 'stones'])} by {where}.",
    ]
    return rng.choice(forms)()


def paragraph(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(3, 7)))


def tale(rng: random.Random, number: int) -> str:
    title = f"TALE {number}. {rng.choice(THINGS).upper()} AND {rng.choice(PEOPLE).upper()}"
    paragraphs = [paragraph(rng) for _ in range(rng.randint(3, 6))]
    return "\n\n".join([title, *paragraphs])


def corpus(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> str:
    rng = random.Random(seed)
    tales: list[str] = []
    size = 0
    while size < target_bytes:
        tales.append(tale(rng, len(tales) + 1))
        size += len(tales[-1]) + 3
    return "\n\n\n".join(tales) + "\n"


if __name__ == "__main__":
    path = Path(__file__).with_name("corpus.txt")
    path.write_text(corpus(), encoding="utf-8")
    print(f"wrote {path} ({path.stat().st_size} bytes)")
