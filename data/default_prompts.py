"""The prompts of the bundled default dataset, generated programmatically and deterministically.

The shipped ``data/default/sharegpt_default.jsonl`` was made with::

    python -m draftsmith.data.default_prompts --out prompts.jsonl
    draftsmith data regenerate prompts.jsonl --out data/default/sharegpt_default.jsonl --max-new-tokens 256

so every assistant turn is the embedded target's own greedy answer (self-distillation). The prompt
set covers chat, writing, coding, math word problems, summarisation of a given passage and
extraction; each conversation gets a second user turn with probability 1/8 (51 of the 285 do).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

CHAT = [
    "What is the difference between weather and climate?",
    "How do vaccines train the immune system?",
    "Why is the sky blue?",
    "What are some good habits for getting better sleep?",
    "Can you explain what inflation is in simple terms?",
    "How does a refrigerator keep food cold?",
    "What should I pack for a three-day hiking trip?",
    "Why do cats purr?",
    "What is the best way to learn a new language as an adult?",
    "How do solar panels produce electricity?",
    "What are the main causes of traffic jams?",
    "How can I make my houseplants healthier?",
    "What is the difference between a virus and a bacterium?",
    "Why do we have leap years?",
    "How does compound interest work?",
    "What are some tips for a successful job interview?",
    "How do airplanes stay in the air?",
    "What is photosynthesis?",
    "Why do onions make people cry?",
    "How can I reduce my household's energy use?",
    "What makes a good team leader?",
    "How do earthquakes happen?",
    "What is the water cycle?",
    "How should I prepare for a marathon?",
    "What is machine learning, in one paragraph?",
    "Why is biodiversity important?",
    "How do I start a vegetable garden on a balcony?",
    "What is the purpose of a central bank?",
    "How can I stay focused while working from home?",
    "What is the difference between a comet and an asteroid?",
]
WRITING_FORMS = [
    "a short poem",
    "a haiku",
    "a two-paragraph story",
    "a product description",
    "a polite email",
    "a limerick",
    "a motivational speech opening",
    "a diary entry",
    "a short dialogue",
    "a tweet",
]
WRITING_TOPICS = [
    "a lighthouse keeper's last night on duty",
    "a new reusable water bottle",
    "the first snow of winter",
    "asking a neighbour to water my plants",
    "a robot learning to paint",
    "a rainy day in the city",
    "a team finishing a difficult project",
    "an old bicycle",
    "a cat who owns a bookshop",
    "moving to a new town",
    "a late train",
    "a community garden opening",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the words in a sentence",
    "removes duplicates from a list while keeping order",
    "computes the factorial of n",
    "merges two sorted lists",
    "finds the largest element of a list",
    "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome",
    "returns the sum of the digits of an integer",
    "flattens a nested list one level deep",
]
CODE_LANGUAGES = ["Python", "JavaScript", "Python", "C", "Rust", "Go"]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mateo", "Nia"]
ITEMS = [("apples", 0.5), ("notebooks", 2.25), ("pencils", 0.75), ("tickets", 12.0), ("muffins", 1.5), ("stamps", 0.9)]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tampere", "Valencia", "Perth", "Montreal"]
COMPANIES = ["Brightwater Labs", "Northfield Foods", "Kestrel Robotics", "Amberline Books", "Solace Health"]
FOLLOW_UPS = [
    "Can you make that shorter?",
    "Can you explain that to a ten-year-old?",
    "Give me one more example.",
    "Now summarise your answer in one sentence.",
    "What is the most important point here?",
]


def _writing(rng: random.Random) -> str:
    return f"Write {rng.choice(WRITING_FORMS)} about {rng.choice(WRITING_TOPICS)}."


def _coding(rng: random.Random) -> str:
    task, language = rng.choice(CODE_TASKS), rng.choice(CODE_LANGUAGES)
    style = rng.choice(["", " Add a short comment.", " Include an example call.", " Keep it under ten lines."])
    return f"Write a {language} function that {task}.{style}"


def _math(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    item, price = rng.choice(ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 15), rng.randint(2, 9)
    forms = [
        f"{name} buys {a} {item} at ${price:.2f} each and pays with a ${(int(a * price) // 10 + 1) * 10} bill. "
        "How much change does {name} get?".replace("{name}", name),
        f"{name} has {a} {item}. {name} gives {b if b < a else a // 2} to {other} and then buys {c} more. "
        f"How many {item} does {name} have now?",
        f"A train travels {a * 10} km in {c} hours. What is its average speed in km/h?",
        f"{name} reads {b} pages a day. How many days does it take to finish a book of {b * c + a} pages?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"{name} and {other} share {a * c} {item} in the ratio {c}:{b}. How many does each get?",
    ]
    return rng.choice(forms) + " Explain your steps."


def _passage(rng: random.Random) -> str:
    company, city = rng.choice(COMPANIES), rng.choice(CITIES)
    year, staff, growth = rng.randint(2005, 2022), rng.randint(12, 900), rng.randint(3, 60)
    product = rng.choice(
        ["a water filter", "a reading app", "a delivery robot", "a plant-based snack", "a clinic scheduler"]
    )
    return (
        f"{company} was founded in {city} in {year}. It began with a small team that wanted to build {product} "
        f"for people who could not afford existing options. Today it employs {staff} people, and last year its "
        f"revenue grew by {growth} percent. The founders say that listening to early customers shaped almost every "
        f"decision, from pricing to design. Critics point out that the company still depends on a single supplier, "
        f"and that expansion outside {city} has been slower than planned."
    )


def _summarise(rng: random.Random) -> str:
    ask = rng.choice(
        [
            "Summarise this passage in two sentences:",
            "Give a one-sentence summary of the text below.",
            "Summarise the key points of this passage as a short bullet list:",
        ]
    )
    return f"{ask}\n\n{_passage(rng)}"


def _extract(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    city = rng.choice(CITIES)
    day, month = rng.randint(1, 28), rng.choice(["March", "June", "September", "November"])
    price = rng.randint(20, 400)
    text = (
        f"Hi {other}, this is {name}. I booked the conference room in {city} for {month} {day} at 10:30. "
        f"The total comes to ${price}, which I paid by card. Please bring the projector and call me at 555-01{day:02d}."
    )
    ask = rng.choice(
        [
            "Extract every name, date, place and amount from this message as JSON:",
            "List the people, the date and the price mentioned in this note:",
            "What is the phone number and the total cost in this message?",
        ]
    )
    return f"{ask}\n\n{text}"


CATEGORIES: dict[str, tuple[int, Callable[[random.Random], str]]] = {
    "chat": (len(CHAT), lambda rng: rng.choice(CHAT)),
    "writing": (55, _writing),
    "coding": (55, _coding),
    "math": (55, _math),
    "summarisation": (45, _summarise),
    "extraction": (45, _extract),
}


def build_prompts(seed: int = 0) -> list[dict]:
    """ShareGPT records with user turns only; regeneration fills in the assistant turns."""
    rng = random.Random(seed)
    records, seen = [], set()
    for category, (count, make) in CATEGORIES.items():
        made = 0
        while made < count:
            prompt = make(rng)
            if prompt in seen:
                continue
            seen.add(prompt)
            turns = [{"from": "human", "value": prompt}]
            if rng.random() < 0.125:
                turns += [{"from": "gpt", "value": "(regenerated)"}, {"from": "human", "value": rng.choice(FOLLOW_UPS)}]
            records.append({"id": f"{category}-{made:03d}", "category": category, "conversations": turns})
            made += 1
    return records


def held_out_questions(per_category: int, seed: int = 1, exclude: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Spec-Bench-format questions from the default prompt generator with another seed, minus every
    prompt the bundled training set already holds (and ``exclude``), ``per_category`` from each category."""
    seen = {r["conversations"][0]["value"] for r in build_prompts(0)} | set(exclude)
    taken: dict[str, int] = {}
    questions = []
    for record in build_prompts(seed):
        prompt, category = record["conversations"][0]["value"], record["category"]
        if prompt in seen or taken.get(category, 0) >= per_category:
            continue
        taken[category] = taken.get(category, 0) + 1
        # "default/" keeps these apart from Spec-Bench's categories (bench adds MT-bench's up as mt_bench)
        questions.append({"question_id": record["id"], "category": f"default/{category}", "turns": [prompt]})
    return questions


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the prompts of draftsmith's default dataset (user turns only).")
    parser.add_argument("--out", type=Path, required=True, help="output JSONL file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = build_prompts(args.seed)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    print(f"wrote {len(records)} prompt records to {args.out}")


if __name__ == "__main__":
    main()
