"""Seeded generator of the kdn-qa corpus: multi-document question answering.

Each example is a handful of short documents about invented towns and people,
and questions whose answers need one document (single-hop) or two documents
read together (two-hop: the mayor of a town is described in another document).

Names are random syllable strings. A name belongs to the held-out (evaluation)
half of the name space when HeldOut(name) is true; training examples never use
such a name and evaluation examples use only such names, so no entity is shared
between training and evaluation and every answer can only come from the
documents in the prompt.

The prompt format is fixed (kdn-bench quality and the launcher demo rely on it):
  BOS + "".join(doc + "\\n" for doc in docs) + "Question: " + q + "\\nAnswer:"
and the model continues with " " + answer + "\\n".

  python3 corpus.py --seed 1 --split eval --count 300 --out eval.jsonl
  python3 corpus.py --seed 0 --split train --count 3   # prints examples
"""

import argparse
import json
import random
import sys
import zlib

BOS = 256
EOS = 257

_ONSETS = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t",
           "v", "z", "br", "dr", "gr", "kr", "tr", "st", "sh", "th", "pl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
_CODAS = ["", "", "", "n", "r", "l", "s", "k", "m", "x", "th"]

JOBS = ["baker", "farmer", "miller", "potter", "weaver", "smith", "tailor",
        "fisher", "healer", "scribe", "mason", "brewer", "hunter", "carpenter",
        "singer", "painter", "teacher", "sailor", "cook", "guard"]


def HeldOut(name):
    """True for names reserved to evaluation (one in eight)."""
    return zlib.crc32(name.encode()) % 8 == 0


def _Syllable(rng):
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


class _Names:
    """Draws distinct names of one split."""

    def __init__(self, rng, held_out):
        self.rng = rng
        self.held_out = held_out
        self.used = set()

    def Draw(self, syllables):
        while True:
            name = "".join(_Syllable(self.rng) for _ in range(syllables))
            name = name[0].upper() + name[1:]
            if len(name) < 4 or len(name) > 8 or name in self.used:
                continue
            if HeldOut(name) != self.held_out:
                continue
            self.used.add(name)
            return name


def _TownDoc(rng, t):
    return "{n} is a town. The mayor of {n} is {m}. {n} has {p} people.".format(
        n=t["name"], m=t["mayor"], p=t["pop"])


def _PersonDoc(rng, p):
    return "{n} was born in {b}. {n} works as a {j}. {n} is {a} years old.".format(
        n=p["name"], b=p["born"], j=p["job"], a=p["age"])


def _SingleHop(rng, ent):
    n = ent["name"]
    if ent["kind"] == "town":
        return rng.choice([
            ("Who is the mayor of {}?".format(n), ent["mayor"]),
            ("How many people live in {}?".format(n), str(ent["pop"])),
        ])
    return rng.choice([
        ("Where was {} born?".format(n), ent["born"]),
        ("What is the job of {}?".format(n), ent["job"]),
        ("How old is {}?".format(n), str(ent["age"])),
    ])


def _TwoHop(rng, town, person, town_first):
    """town first: town -> mayor person -> attribute; else person -> birth town."""
    if town_first:
        n = town["name"]
        return rng.choice([
            ("Where was the mayor of {} born?".format(n), person["born"]),
            ("What is the job of the mayor of {}?".format(n), person["job"]),
            ("How old is the mayor of {}?".format(n), str(person["age"])),
        ])
    n = person["name"]
    return rng.choice([
        ("Who is the mayor of the town where {} was born?".format(n), town["mayor"]),
        ("How many people live in the town where {} was born?".format(n),
         str(town["pop"])),
    ])


def MakeWorld(rng, names, n_docs):
    """Returns (docs, entities, links): n_docs entities each with one document.

    links are (town, person, town_first) pairs whose two documents are both
    present, i.e. the two-hop questions this world can answer.
    """
    n_towns = rng.randint(1, n_docs - 1)
    n_people = n_docs - n_towns
    towns = [{"kind": "town", "name": names.Draw(2),
              "pop": rng.randint(100, 990) * 10} for _ in range(n_towns)]
    people = [{"kind": "person", "name": names.Draw(2), "job": rng.choice(JOBS),
               "age": rng.randint(18, 89)} for _ in range(n_people)]
    # Mayors: some present people, the rest outside names.
    free = list(range(n_people))
    rng.shuffle(free)
    for t in towns:
        if free and rng.random() < 0.7:
            t["mayor_of"] = free.pop()
            t["mayor"] = people[t["mayor_of"]]["name"]
        else:
            t["mayor"] = names.Draw(2)
    for p in people:
        if towns and rng.random() < 0.6:
            p["born_in"] = rng.randrange(n_towns)
            p["born"] = towns[p["born_in"]]["name"]
        else:
            p["born"] = names.Draw(2)
    links = []
    for t in towns:
        if "mayor_of" in t:
            links.append((t, people[t["mayor_of"]], True))
    for p in people:
        if "born_in" in p:
            links.append((towns[p["born_in"]], p, False))
    ents = towns + people
    rng.shuffle(ents)
    docs = [_TownDoc(rng, e) if e["kind"] == "town" else _PersonDoc(rng, e)
            for e in ents]
    return docs, ents, links


def Prompt(docs, question):
    """The prompt text after BOS (the caller prepends BOS)."""
    return "".join(d + "\n" for d in docs) + "Question: " + question + "\nAnswer:"


def MakeExample(rng, held_out, hops, n_docs=None, names=None):
    """One eval-style example with a single question of the given hop count."""
    names = names or _Names(rng, held_out)
    while True:
        n = n_docs or rng.randint(2, 8)
        docs, ents, links = MakeWorld(rng, names, n)
        if hops == 2:
            if not links:
                continue
            t, p, tf = rng.choice(links)
            q, a = _TwoHop(rng, t, p, tf)
        else:
            q, a = _SingleHop(rng, rng.choice(ents))
        return {"documents": docs, "question": q, "answer": a, "hops": hops}


def MakeTrainText(rng, max_questions=6, max_docs=8, two_hop_share=0.5):
    """One training sequence: documents then several question/answer pairs.

    Returns (text, answer_spans): spans are (start, end) byte offsets in text
    of each " answer\\n" continuation, for loss weighting. The first question
    follows the documents exactly as in an evaluation prompt.
    """
    names = _Names(rng, held_out=False)
    n = rng.randint(2, max_docs)
    docs, ents, links = MakeWorld(rng, names, n)
    qas = []
    k = rng.randint(1, max_questions)
    for _ in range(k):
        if links and rng.random() < two_hop_share:
            t, p, tf = rng.choice(links)
            q, a = _TwoHop(rng, t, p, tf)
            # The bridge entity must not be given away by an earlier answer.
            bridge = p["name"] if tf else t["name"]
            qas.append((q, a, 2, bridge))
        else:
            q, a = _SingleHop(rng, rng.choice(ents))
            qas.append((q, a, 1, None))
    # Dedupe questions; put two-hop ones before any answer that names their bridge.
    seen = set()
    qas = [x for x in qas if not (x[0] in seen or seen.add(x[0]))]
    rng.shuffle(qas)
    ordered = []
    for x in qas:
        if x[2] == 2:
            ordered.insert(next((i for i, y in enumerate(ordered) if y[1] == x[3]),
                                len(ordered)), x)
        else:
            ordered.append(x)
    text = "".join(d + "\n" for d in docs)
    spans = []
    for q, a, _, _ in ordered:
        text += "Question: " + q + "\nAnswer:"
        start = len(text)
        text += " " + a + "\n"
        spans.append((start, len(text)))
    return text, spans


def EvalSet(seed, count):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        out.append(MakeExample(rng, held_out=True, hops=1 if i % 2 == 0 else 2))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", choices=["train", "eval"], default="train")
    ap.add_argument("--count", type=int, default=3)
    ap.add_argument("--out", default="-")
    args = ap.parse_args()
    f = sys.stdout if args.out == "-" else open(args.out, "w")
    if args.split == "eval":
        for ex in EvalSet(args.seed, args.count):
            f.write(json.dumps(ex) + "\n")
    else:
        rng = random.Random(args.seed)
        for _ in range(args.count):
            text, spans = MakeTrainText(rng)
            f.write(json.dumps({"text": text, "answer_spans": spans}) + "\n")


if __name__ == "__main__":
    main()
