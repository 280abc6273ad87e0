"""The prompts of `bench/spec_decode.py`: three chat workloads and a warm-up set.

`conversations(workload, n)` -> the first n chat conversations ([{"role", "content"}]) of
`workload` (cycled when n exceeds its prompt count). Passages are public domain: the
Gettysburg Address (1863), the opening of *A Tale of Two Cities* (Dickens, 1859) and
chapter 1 of *Pride and Prejudice* (Austen, 1813; `tests/data/corpus_pd.txt`).
"""

from __future__ import annotations

from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "corpus_pd.txt"

GETTYSBURG = """Four score and seven years ago our fathers brought forth on this continent, a \
new nation, conceived in Liberty, and dedicated to the proposition that all men are created \
equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so \
conceived and so dedicated, can long endure. We are met on a great battle-field of that war. \
We have come to dedicate a portion of that field, as a final resting place for those who here \
gave their lives that that nation might live. It is altogether fitting and proper that we \
should do this.

But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- \
this ground. The brave men, living and dead, who struggled here, have consecrated it, far \
above our poor power to add or detract. The world will little note, nor long remember what \
we say here, but it can never forget what they did here. It is for us the living, rather, to \
be dedicated here to the unfinished work which they who fought here have thus far so nobly \
advanced."""

TWO_CITIES = """It was the best of times, it was the worst of times, it was the age of \
wisdom, it was the age of foolishness, it was the epoch of belief, it was the epoch of \
incredulity, it was the season of Light, it was the season of Darkness, it was the spring of \
hope, it was the winter of despair, we had everything before us, we had nothing before us, we \
were all going direct to Heaven, we were all going direct the other way--in short, the period \
was so far like the present period, that some of its noisiest authorities insisted on its \
being received, for good or for evil, in the superlative degree of comparison only.

There were a king with a large jaw and a queen with a plain face, on the throne of England; \
there were a king with a large jaw and a queen with a fair face, on the throne of France. In \
both countries it was clearer than crystal to the lords of the State preserves of loaves and \
fishes, that things in general were settled for ever."""

GROUNDED_TASKS = (
    "Repeat the following text exactly, word for word.\n\n{p}",
    "Quote the first paragraph of the following text.\n\n{p}",
    "Rewrite the following text with every double quote replaced by a single quote. Change "
    "nothing else.\n\n{p}",
    "Summarize the following text, quoting its key sentences.\n\n{p}",
    "Fix any spelling mistakes in the following text and return the whole text.\n\n{p}",
    "Copy the following text, but in present tense.\n\n{p}",
    "Here is a text:\n\n{p}\n\nRepeat it back to me.",
    "Split the following text into sentences, one per line.\n\n{p}",
)

CODE = (
    "Write a Python class `Record` with fields a, b, c, d, e, f, g and h, each with a getter "
    "method get_<name> and a setter method set_<name>.",
    "Write a Java class `Person` with private fields name, age, email, phone, street, city, "
    "country and zip, and a public getter and setter for each field.",
    "Continue this code for the fields c, d, e, f, g and h:\n\n```python\nclass Config:\n"
    "    def get_a(self):\n        return self._a\n\n    def set_a(self, value):\n"
    "        self._a = value\n\n    def get_b(self):\n        return self._b\n\n"
    "    def set_b(self, value):\n        self._b = value\n```",
    "Write a C enum of the twelve months and a function with a switch statement that returns "
    "each month's name as a string.",
    "Write SQL CREATE TABLE statements for the tables users, orders, products, payments and "
    "reviews; each has id, created_at and updated_at columns.",
    "Write an HTML table with ten rows of example data and the columns Name, Age and City.",
    "Write pytest tests for the functions add, sub, mul and div: one test function each, "
    "each with three assert statements.",
    "Continue this list up to 20:\n\n```python\nSQUARES = {\n    1: 1,\n    2: 4,\n    3: 9,\n"
    "    4: 16,\n```",
)

CHAT = (
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "Write a short poem about autumn.",
    "What are the benefits of regular exercise?",
    "How do I make a good cup of tea?",
    "Tell me a fun fact about octopuses.",
    "What should I pack for a weekend camping trip?",
)

WARMUP = "warmup"
_WARMUP = ("Hello! Who are you?", "Name three colours.", "Count from one to ten.",
           "What is two plus two?", "Say something nice.", "Spell the word cat.",
           "What day comes after Monday?", "Write one sentence about the sea.")


def passages(min_chars: int = 1000) -> list[str]:
    """Two embedded passages, then the corpus chapter in paragraph groups of >= min_chars."""
    out, cur = [GETTYSBURG, TWO_CITIES], ""
    for para in CORPUS.read_text().split("\n\n"):
        cur = f"{cur}\n\n{para.strip()}" if cur else para.strip()
        if len(cur) >= min_chars:
            out.append(cur)
            cur = ""
    return out


def _user_texts(workload: str) -> list[str]:
    if workload == "grounded":
        ps = passages()
        return [t.format(p=ps[i % len(ps)]) for i, t in enumerate(GROUNDED_TASKS)]
    return list({"code": CODE, "chat": CHAT, WARMUP: _WARMUP}[workload])


WORKLOADS = ("grounded", "code", "chat")


def conversations(workload: str, n: int) -> list[list[dict[str, str]]]:
    texts = _user_texts(workload)
    return [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(n)]
