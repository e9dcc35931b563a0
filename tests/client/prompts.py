"""Prompts of real-looking prose for the client tests: `paragraphs` of a
harbour ledger whose numbers change with `seed` (about 60 SmolLM2 tokens a
paragraph), so that each test has text no other test stored."""

PARAGRAPH = ("The harbour town of Kessel keeps a ledger of every ship that docks there. "
             "In {year} the ledger records {n} ships, the largest a grain barge of {t} tonnes "
             "from the river ports, and the smallest a fishing boat named after the keeper's "
             "daughter. ")


def text(seed, paragraphs):
    return "".join(PARAGRAPH.format(year=1800 + seed * 40 + i, n=17 + 3 * i + seed,
                                    t=120 + 11 * i) for i in range(paragraphs))
