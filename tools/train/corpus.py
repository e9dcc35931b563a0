"""Seeded generator of the kdn-qa corpus: multi-document question answering.

Each example is a handful of short documents about invented towns and people,
then a question, in one of three families:

  single   the answer is in one document ("Where was Soulgai born?");
  two-hop  two documents read together: an attribute of a town's mayor, or
           the mayor or population of the town where someone was born;
  coref    a person is named in one document and referred to by a pronoun in
           the next one ("Faisnar was born in Tekshu." then "He works as a
           potter. He is 24 years old."); the question names the person and
           asks what the second document says. Every coref example holds at
           least two such pairs, so the pronoun document that answers can
           only be told apart from the others by the document before it: its
           KV must have seen that document. Full KV reuse (each document
           computed alone) loses exactly that, which is what CacheBlend's
           selective recompute is meant to restore.

Names are random syllable strings. A name belongs to the held-out (evaluation)
eighth of the name space when HeldOut(name) is true; training examples never use
such a name and evaluation examples use only such names, so no entity is shared
between training and evaluation and every answer can only come from the
documents in the prompt.

Questions come in phrasings. Training and eval.jsonl use the `train`
phrasings; eval-phrasing.jsonl uses only the `novel` ones, which training
never produces ("Tell me how old Zerea is."), to measure how far the model's
reading goes beyond its templates.

The prompt format is fixed (kdn-bench quality and the launcher demo rely on it):
  BOS + "".join(doc + "\\n" for doc in docs) + "Question: " + q + "\\nAnswer:"
and the model continues with " " + answer + "\\n". Answers state the facts
they rest on, in the documents' words with the pronoun replaced by the name.

  python3 corpus.py --seed 1 --split eval --count 300 --out eval.jsonl
  python3 corpus.py --seed 2 --split eval --phrasing novel --count 150 --out eval-phrasing.jsonl
  python3 corpus.py --seed 0 --split train --count 3   # prints examples
"""

import argparse
import json
import random
import sys
import zlib

BOS = 256
EOS = 257

FAMILIES = ("single", "two-hop", "coref")

_ONSETS = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t",
           "v", "z", "br", "dr", "gr", "kr", "tr", "st", "sh", "th", "pl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
_CODAS = ["", "", "", "n", "r", "l", "s", "k", "m", "x", "th"]

JOBS = ["baker", "farmer", "miller", "potter", "weaver", "smith", "tailor",
        "fisher", "healer", "scribe", "mason", "brewer", "hunter", "carpenter",
        "singer", "painter", "teacher", "sailor", "cook", "guard"]

# Question phrasings per relation; "{}" is the subject (a name, or "the mayor
# of X" / "the town where X was born" in two-hop questions).
PHRASINGS = {
    "train": {
        "mayor": ["Who is the mayor of {}?", "Which person is the mayor of {}?",
                  "Name the mayor of {}."],
        "pop": ["How many people live in {}?", "What is the population of {}?",
                "How many people does {} have?"],
        "born": ["Where was {} born?", "In which town was {} born?",
                 "What town was {} born in?"],
        "job": ["What is the job of {}?", "What does {} work as?", "Which job does {} do?"],
        "age": ["How old is {}?", "What is the age of {}?", "How many years old is {}?"],
    },
    "novel": {
        "mayor": ["Tell me who the mayor of {} is.", "Who serves as the mayor of {}?"],
        "pop": ["Tell me how many people live in {}.", "How large is the population of {}?"],
        "born": ["Tell me where {} was born.", "Which town is the birthplace of {}?"],
        "job": ["Tell me the job of {}.", "What kind of work does {} do?"],
        "age": ["Tell me how old {} is.", "What age is {}?"],
    },
}


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


# Facts as sentences. `who` is how the sentence names its subject (the name,
# or a pronoun in a coref person's second document).
def _Mayor(t):
    return "The mayor of {} is {}.".format(t["name"], t["mayor"])


def _Pop(t):
    return "{} has {} people.".format(t["name"], t["pop"])


def _Born(p, who=None):
    return "{} was born in {}.".format(who or p["name"], p["born"])


def _Job(p, who=None):
    return "{} works as a {}.".format(who or p["name"], p["job"])


def _Age(p, who=None):
    return "{} is {} years old.".format(who or p["name"], p["age"])


_FACT = {"mayor": _Mayor, "pop": _Pop, "born": _Born, "job": _Job, "age": _Age}
_TOWN_RELATIONS = ("mayor", "pop")
_PERSON_RELATIONS = ("born", "job", "age")
_COREF_RELATIONS = ("job", "age")  # the facts of a coref person's pronoun document


def _Docs(ent):
    """The documents of one entity: one, or two for a coref person."""
    if ent["kind"] == "town":
        return [" ".join(("{} is a town.".format(ent["name"]), _Mayor(ent), _Pop(ent)))]
    if ent.get("pronoun"):
        return [_Born(ent), " ".join((_Job(ent, ent["pronoun"]), _Age(ent, ent["pronoun"])))]
    return [" ".join((_Born(ent), _Job(ent), _Age(ent)))]


def _Ask(rng, phrasing, relation, subject):
    return rng.choice(PHRASINGS[phrasing][relation]).format(subject)


def _SingleHop(rng, ent, phrasing="train", relations=None):
    """(question, answer) about one entity: the answer is its document's sentence."""
    if relations is None:
        relations = _TOWN_RELATIONS if ent["kind"] == "town" else _PERSON_RELATIONS
    rel = rng.choice(relations)
    return _Ask(rng, phrasing, rel, ent["name"]), _FACT[rel](ent)


def _TwoHop(rng, town, person, town_first, phrasing="train"):
    """town first: town -> mayor person -> attribute; else person -> birth town.

    The answer states both facts in the documents' words, the bridge first.
    """
    if town_first:
        rel = rng.choice(_PERSON_RELATIONS)
        q = _Ask(rng, phrasing, rel, "the mayor of " + town["name"])
        return q, _Mayor(town) + " " + _FACT[rel](person)
    rel = rng.choice(_TOWN_RELATIONS)
    q = _Ask(rng, phrasing, rel, "the town where {} was born".format(person["name"]))
    return q, _Born(person) + " " + _FACT[rel](town)


def MakeWorld(rng, names, n_docs, n_coref=0):
    """Returns (docs, entities, links): entities with about n_docs documents.

    n_coref of the people are coref people (two documents each, the second
    one with a pronoun, always right after the first); the others have one
    document each. links are (town, person, town_first) pairs whose documents
    are all present, i.e. the two-hop questions this world can answer.
    """
    n_ents = max(2, n_docs - n_coref)
    n_towns = rng.randint(1, max(1, n_ents - 1 - n_coref))
    n_people = n_ents - n_towns
    towns = [{"kind": "town", "name": names.Draw(2),
              "pop": rng.randint(100, 990) * 10} for _ in range(n_towns)]
    people = [{"kind": "person", "name": names.Draw(2), "job": rng.choice(JOBS),
               "age": rng.randint(18, 89)} for _ in range(n_people)]
    # Coref people do different jobs, so that only the right pronoun
    # document answers a question about one of them.
    for p, job in zip(people[:n_coref], rng.sample(JOBS, n_coref)):
        p["pronoun"] = rng.choice(("He", "She"))
        p["job"] = job
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
    docs = [d for e in ents for d in _Docs(e)]
    return docs, ents, links


def Prompt(docs, question):
    """The prompt text after BOS (the caller prepends BOS)."""
    return "".join(d + "\n" for d in docs) + "Question: " + question + "\nAnswer:"


def MakeExample(rng, held_out, family, n_docs=None, names=None, phrasing="train"):
    """One eval-style example of a family (see FAMILIES) with a single question.

    single and two-hop worlds have no coref people (the families of the first
    kdn-qa model); a coref world has 2 or 3 coref people among 4 to 8
    documents, and the question asks what a pronoun document says.
    """
    if family not in FAMILIES:
        raise ValueError("unknown family {!r}".format(family))
    names = names or _Names(rng, held_out)
    while True:
        n = n_docs or rng.randint(2, 8)
        if family == "coref":
            n_coref = rng.randint(2, 3)
            # At least one town besides the coref people, so that MakeWorld
            # has room for all of them.
            n = max(n, 2 * n_coref + 1)
            docs, ents, links = MakeWorld(rng, names, n, n_coref)
            target = rng.choice([e for e in ents if e.get("pronoun")])
            q, a = _SingleHop(rng, target, phrasing, _COREF_RELATIONS)
            hops = 2
        elif family == "two-hop":
            docs, ents, links = MakeWorld(rng, names, n)
            if not links:
                continue
            q, a = _TwoHop(rng, *rng.choice(links), phrasing=phrasing)
            hops = 2
        else:
            docs, ents, links = MakeWorld(rng, names, n)
            q, a = _SingleHop(rng, rng.choice(ents), phrasing)
            hops = 1
        return {"documents": docs, "question": q, "answer": a, "hops": hops,
                "family": family}


def MakeTrainText(rng, max_questions=6, max_docs=8, two_hop_share=0.5, coref_share=0.0):
    """One training sequence: documents then several question/answer pairs.

    With probability coref_share the world has up to 3 coref people (as many
    as MakeWorld has room for beside at least one town), and a
    question about one of them asks what its pronoun document says.
    Returns (text, answer_spans): spans are (start, end) byte offsets in text
    of each " answer\\n" continuation, for loss weighting. The first question
    follows the documents exactly as in an evaluation prompt.
    """
    names = _Names(rng, held_out=False)
    n = rng.randint(2, max_docs)
    n_coref = 0
    if rng.random() < coref_share:
        n_coref = rng.randint(1, min(3, max(1, n // 2)))
    docs, ents, links = MakeWorld(rng, names, n, n_coref)
    qas = {}
    for _ in range(rng.randint(1, max_questions)):
        if links and rng.random() < two_hop_share:
            q, a = _TwoHop(rng, *rng.choice(links))
        else:
            ent = rng.choice(ents)
            if ent.get("pronoun") and rng.random() < 0.8:
                q, a = _SingleHop(rng, ent, relations=_COREF_RELATIONS)
            else:
                q, a = _SingleHop(rng, ent)
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


def EvalSet(seed, count, phrasing="train"):
    """count held-out examples, the families in turn."""
    rng = random.Random(seed)
    return [MakeExample(rng, held_out=True, family=FAMILIES[i % len(FAMILIES)],
                        phrasing=phrasing) for i in range(count)]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", choices=["train", "eval"], default="train")
    ap.add_argument("--phrasing", choices=sorted(PHRASINGS), default="train",
                    help="question phrasings of an eval split")
    ap.add_argument("--count", type=int, default=3)
    ap.add_argument("--coref-share", type=float, default=0.4,
                    help="share of train examples with coref people")
    ap.add_argument("--out", default="-")
    args = ap.parse_args()
    f = sys.stdout if args.out == "-" else open(args.out, "w")
    if args.split == "eval":
        for ex in EvalSet(args.seed, args.count, args.phrasing):
            f.write(json.dumps(ex) + "\n")
    else:
        rng = random.Random(args.seed)
        for _ in range(args.count):
            text, spans = MakeTrainText(rng, coref_share=args.coref_share)
            f.write(json.dumps({"text": text, "answer_spans": spans}) + "\n")


if __name__ == "__main__":
    main()
