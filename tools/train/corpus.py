"""Seeded generator of the kdn-qa corpus: multi-document question answering.

Each example is a handful of short documents about invented towns and people,
and questions whose answers need one document (single-hop) or two documents
read together (two-hop: the mayor of a town is described in another document).

Names are random syllable strings. A name belongs to the held-out (evaluation)
eighth of the name space when HeldOut(name) is true; training examples never use
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


def _Mayor(t):
    return "The mayor of {} is {}.".format(t["name"], t["mayor"])


def _Pop(t):
    return "{} has {} people.".format(t["name"], t["pop"])


def _Born(p):
    return "{} was born in {}.".format(p["name"], p["born"])


def _Job(p):
    return "{} works as a {}.".format(p["name"], p["job"])


def _Age(p):
    return "{} is {} years old.".format(p["name"], p["age"])


def _TownDoc(rng, t):
    return " ".join(("{} is a town.".format(t["name"]), _Mayor(t), _Pop(t)))


def _PersonDoc(rng, p):
    return " ".join((_Born(p), _Job(p), _Age(p)))


def _SingleHop(rng, ent):
    """(question, answer): the answer is the document's own sentence."""
    n = ent["name"]
    if ent["kind"] == "town":
        return rng.choice([
            ("Who is the mayor of {}?".format(n), _Mayor(ent)),
            ("How many people live in {}?".format(n), _Pop(ent)),
        ])
    return rng.choice([
        ("Where was {} born?".format(n), _Born(ent)),
        ("What is the job of {}?".format(n), _Job(ent)),
        ("How old is {}?".format(n), _Age(ent)),
    ])


def _TwoHop(rng, town, person, town_first):
    """town first: town -> mayor person -> attribute; else person -> birth town.

    The answer states both facts in the documents' words, the bridge first.
    """
    if town_first:
        n = town["name"]
        q, a = rng.choice([
            ("Where was the mayor of {} born?", _Born(person)),
            ("What is the job of the mayor of {}?", _Job(person)),
            ("How old is the mayor of {}?", _Age(person)),
        ])
        return q.format(n), _Mayor(town) + " " + a
    n = person["name"]
    q, a = rng.choice([
        ("Who is the mayor of the town where {} was born?", _Mayor(town)),
        ("How many people live in the town where {} was born?", _Pop(town)),
    ])
    return q.format(n), _Born(person) + " " + a


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
    qas = {}
    for _ in range(rng.randint(1, max_questions)):
        if links and rng.random() < two_hop_share:
            q, a = _TwoHop(rng, *rng.choice(links))
        else:
            q, a = _SingleHop(rng, rng.choice(ents))
        qas[q] = a
    text = "".join(d + "\n" for d in docs)
    spans = []
    for q, a in qas.items():
        text += "Question: " + q + "\nAnswer:"
        start = len(text)
        text += " " + a + "\n"
        spans.append((start, len(text)))
    return text, spans


def MakeCopyText(rng, max_docs=8):
    """A warm-up sequence: documents, then the same documents again.

    Every byte of the repeat is predictable by finding the same context
    earlier and copying what follows, the mechanism (an induction head) that
    answering needs; such sequences grow it in far fewer steps than questions
    alone. Returns (text, spans) like MakeTrainText, the span being the repeat.
    """
    names = _Names(rng, held_out=False)
    docs, _, _ = MakeWorld(rng, names, rng.randint(2, max_docs))
    text = "".join(d + "\n" for d in docs)
    start = len(text)
    text += text
    return text, [(start, len(text))]


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
