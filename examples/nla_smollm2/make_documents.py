"""Write the text documents the NLA example extracts its vectors from: short seeded sentences about
varied topics (a `text` column), as a parquet file.

    python examples/nla_smollm2/make_documents.py OUT.parquet [COUNT]
"""

from __future__ import annotations

import random
import sys

from ember.data.parquet import write_parquet

ANIMALS = ["fox", "cat", "horse", "owl", "whale", "bee", "wolf", "rabbit", "eagle", "turtle"]
COLORS = ["red", "green", "blue", "golden", "black", "white", "purple", "silver"]
PLACES = ["forest", "kitchen", "harbor", "desert", "library", "mountain", "garden", "station", "river", "market"]
VERBS = ["sleeps", "runs", "sings", "waits", "hides", "eats", "swims", "watches the sky"]
TIMES = ["at dawn", "every evening", "in winter", "after the storm", "on Sunday", "before noon"]
FACTS = ["The sum of {a} and {b} is {c}.", "There are {a} boxes and {b} chairs in the room.",
         "Train {a} leaves at {b} o'clock.", "She paid {a} dollars for {b} apples."]


def document(rng: random.Random) -> str:
    """One or two sentences: a scene, sometimes followed by a fact with numbers."""
    scene = (f"In the {rng.choice(PLACES)}, a {rng.choice(COLORS)} {rng.choice(ANIMALS)} {rng.choice(VERBS)} "
             f"{rng.choice(TIMES)}.")
    if rng.random() < 0.5:
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        scene += " " + rng.choice(FACTS).format(a=a, b=b, c=a + b)
    return scene


def main(out: str, count: int = 2048, seed: int = 0) -> str:
    rng = random.Random(seed)
    return str(write_parquet([{"text": document(rng)} for _ in range(count)], out))


if __name__ == "__main__":
    print(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2048))
