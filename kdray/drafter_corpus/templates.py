"""Self-instruct by templates: each seed kind's prompt templates across the categories (explanation, how-to,
code, math, writing, conversation), and math word problems generated with their numbers."""
from __future__ import annotations

import random
from collections.abc import Iterator

from kdray.drafter_corpus.sources import Seed

CATEGORIES = ("explanation", "how-to", "code", "math", "writing", "conversation")

TEMPLATES: dict[str, list[tuple[str, str]]] = {
    "pydoc": [  # the passage of the Python reference follows every one
        ("explanation", "Explain the following passage from the Python language reference in plain words."),
        ("writing", "Summarize the key points of this excerpt from the Python documentation."),
        ("code", "Write a short Python example that illustrates the following documentation, and explain it."),
        ("conversation", "A beginner is reading this part of the Python reference. What might confuse them? "
                         "Explain."),
        ("how-to", "How would I use what this part of the Python reference describes in a real program?"),
    ],
    "module": [
        ("explanation", "What is the Python module `{name}` (from {package}) for? Its documentation says:"),
        ("how-to", "How do I get started with the `{name}` module of {package}? Its documentation says:"),
        ("writing", "Rewrite this documentation of the Python module `{name}` as a short, friendly introduction:"),
    ],
    "function": [
        ("code", "Write a Python function `{signature}` that does what this docstring describes:"),
        ("code", "Implement `{signature}` in Python, with a short test. Specification:"),
        ("explanation", "Explain what `{name}` from the Python package {package} does, given its documentation:"),
        ("how-to", "How do I use `{name}` from {package}? Show an example call. Its documentation:"),
        ("conversation", "I'm using {package} and found `{name}`. When would I call it? The docs say:"),
    ],
    "class": [
        ("explanation", "Explain what the class `{name}` from the Python package {package} represents:"),
        ("code", "Write a minimal Python class like `{name}` as this docstring describes it:"),
        ("how-to", "How do I create and use a `{name}` from {package}? Its documentation:"),
    ],
    "command": [
        ("how-to", "How do I {summary} on Linux? Show example commands."),
        ("explanation", "Explain what the `{name}` command does and when to use it. Its manual says:"),
        ("code", "Write a short shell script that uses `{name}` ({summary}), and explain each line."),
        ("conversation", "A colleague told me to use `{name}`. What is it, in simple terms?"),
    ],
    "cfunction": [
        ("code", "Write a small C program that uses `{name}` ({summary}) and checks for errors."),
        ("explanation", "Explain what `{name}` does ({summary}). Its manual page says:"),
        ("how-to", "How do I use `{name}` correctly in C? Its manual page says:"),
    ],
    "topic": [
        ("explanation", "Explain {name} ({summary}) in plain words. The manual page says:"),
        ("how-to", "How do I work with {name} ({summary}) on a Linux system?"),
        ("writing", "Write a short overview of {name} for a newcomer, based on this manual text:"),
    ],
    "term": [
        ("explanation", "Explain the computing term \"{term}\" in plain words."),
        ("explanation", "What is {term}? Here is a dictionary definition; explain it with an example:"),
        ("conversation", "People at work keep mentioning {term}. What is it, and why does it matter?"),
        ("writing", "Write a short glossary entry on {term} for a general audience."),
        ("code", "Give a small code example that illustrates {term}, and explain it."),
    ],
    "word": [
        ("explanation", "What does the word \"{word}\" mean? Use it in two example sentences."),
        ("writing", "Write a short poem about {word}."),
        ("writing", "Write a short story, about a paragraph long, in which {word} plays a part."),
        ("conversation", "Let's chat: what comes to mind when you hear the word \"{word}\"?"),
        ("how-to", "Explain how to teach a child the word \"{word}\"."),
    ],
    "math": [
        ("math", "{text}"),
        ("math", "{text} Show your work step by step."),
        ("math", "{text} Explain your reasoning, then give the final answer."),
    ],
}
PASSAGE_KINDS = {"pydoc", "module", "function", "class", "command", "cfunction", "topic", "term"}  # text follows


def seed_prompts(seed: Seed, count: int, rng: random.Random) -> list[tuple[str, str]]:
    """(category, prompt) for up to ``count`` of the seed kind's templates, picked at random, categories
    differing where the kind has enough of them."""
    firsts, rest, seen = [], [], set()
    for t in rng.sample(TEMPLATES[seed.kind], len(TEMPLATES[seed.kind])):
        (rest if t[0] in seen else firsts).append(t)
        seen.add(t[0])
    order = firsts + rest
    out = []
    for category, template in order[:count]:
        text = template.format(**seed.fields)
        if seed.kind in PASSAGE_KINDS and (seed.kind != "command" or category != "how-to"):
            text = f"{text}\n\n{seed.fields['text']}"
        out.append((category, text))
    return out


# ---------------------------------------------------------------- math problems

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mo", "Nia")
ITEMS = ("apples", "books", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards", "tickets")


def math_problem(kind: str, rng: random.Random) -> str:
    """One problem of ``kind`` with numbers drawn from ``rng``."""
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    who, other, item = *rng.sample(NAMES, 2), rng.choice(ITEMS)
    if kind == "arithmetic":
        op = rng.choice(["+", "-", "*"])
        return f"What is {rng.randint(100, 9999)} {op} {rng.randint(10, 999)}?"
    if kind == "division":
        return f"What is {a * c * 7} divided by {c}?"
    if kind == "percent":
        return f"What is {rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 75])}% of {rng.randint(20, 2000)}?"
    if kind == "fractions":
        return f"Add the fractions {a % 9 + 1}/{c} and {b % 7 + 1}/{rng.randint(2, 10)}, and simplify the result."
    if kind == "equation":
        x = rng.randint(-20, 20)
        return f"Solve for x: {c}x + {a} = {c * x + a}."
    if kind == "share":
        return f"{who} has {a * c} {item} and shares them equally among {c} friends. How many does each friend get?"
    if kind == "change":
        return (f"{who} had {a + b} {item}, gave {b} to {other}, then bought {c} more. How many {item} does {who} "
                "have now?")
    if kind == "rate":
        return f"A train travels at {a + 20} km/h for {c} hours. How far does it go?"
    if kind == "price":
        return (f"{who} buys {c} notebooks at ${a / 4:.2f} each and pays with a ${(c * a // 40 + 1) * 10} bill. "
                f"How much change does {who} get?")
    if kind == "average":
        return f"What is the average of {', '.join(str(rng.randint(1, 100)) for _ in range(c % 5 + 3))}?"
    if kind == "area":
        return f"A rectangular garden is {a} m long and {b} m wide. What are its area and its perimeter?"
    if kind == "ages":
        return (f"{who} is {c} years older than {other}. Together they are {2 * a + c} years old. How old is each "
                "of them?")
    raise ValueError(f"unknown math problem kind '{kind}'")


MATH_KINDS = ("arithmetic", "division", "percent", "fractions", "equation", "share", "change", "rate", "price",
              "average", "area", "ages")


def math_seeds(count: int, seed: int) -> Iterator[Seed]:
    """``count`` generated problems, the kinds in turn; each problem its own document."""
    rng = random.Random(f"math:{seed}")
    for i in range(count):
        kind = MATH_KINDS[i % len(MATH_KINDS)]
        yield Seed("math", f"math:{kind}:{i}", "math", {"text": math_problem(kind, rng)})
