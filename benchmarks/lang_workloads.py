"""Deterministic workloads for bench_lang.py: a few-shot multiple-choice prompt about easy facts,
and the plain prompts of the language-overhead benchmark.

Everything here is fixed text (no randomness), so that every run and every system sees the same
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MCQuestion:
    question: str
    options: tuple[str, str, str, str]
    answer: str  # one of options

    def __post_init__(self) -> None:
        if self.answer not in self.options:
            raise ValueError(f"{self.question!r}: answer {self.answer!r} is not an option")


_LETTERS = "ABCD"

INSTRUCTIONS = (
    "The following are multiple choice questions about general knowledge: geography, science, "
    "history, numbers and everyday life. Each question has four options, labelled A to D, and "
    "exactly one of them is correct. Read the question and all four options carefully, then "
    "write the text of the correct option after \"Answer:\".\n\n"
)

# The worked examples of the shared few-shot prefix (with a one-line reason each, which makes
# the prefix long enough to be worth caching, as real few-shot prompts are).
FEW_SHOT: tuple[tuple[MCQuestion, str], ...] = (
    (MCQuestion("What is the capital of France?", ("Berlin", "Paris", "Madrid", "Rome"), "Paris"),
     "Paris has been the capital of France for most of its history and is its largest city."),
    (MCQuestion("How many legs does a spider have?", ("six", "eight", "ten", "four"), "eight"),
     "Spiders are arachnids, and all arachnids have eight legs, unlike insects with six."),
    (MCQuestion("Which planet is known as the Red Planet?", ("Venus", "Jupiter", "Mars", "Saturn"), "Mars"),
     "Iron oxide dust on its surface gives Mars its reddish colour in the night sky."),
    (MCQuestion("What is the boiling point of water at sea level in degrees Celsius?",
                ("50", "100", "150", "200"), "100"),
     "At normal atmospheric pressure, pure water boils at one hundred degrees Celsius."),
    (MCQuestion("Which animal is the largest mammal on Earth?",
                ("African elephant", "Blue whale", "Giraffe", "Polar bear"), "Blue whale"),
     "The blue whale can grow to about thirty metres long, larger than any other animal."),
    (MCQuestion("What color do you get by mixing blue and yellow paint?", ("Green", "Purple", "Orange", "Brown"),
                "Green"),
     "Blue and yellow are primary colours of paint, and together they make green."),
    (MCQuestion("How many days are there in a week?", ("five", "six", "seven", "eight"), "seven"),
     "A week has seven days, from Monday to Sunday, in calendars all over the world."),
    (MCQuestion("Which ocean lies between Europe and North America?",
                ("Pacific Ocean", "Indian Ocean", "Arctic Ocean", "Atlantic Ocean"), "Atlantic Ocean"),
     "Ships crossing from Europe to North America sail across the Atlantic Ocean."),
    (MCQuestion("What gas do plants take in from the air to make their food?",
                ("Oxygen", "Carbon dioxide", "Nitrogen", "Helium"), "Carbon dioxide"),
     "In photosynthesis, plants use sunlight to turn carbon dioxide and water into sugar."),
    (MCQuestion("Who wrote the play Romeo and Juliet?",
                ("Charles Dickens", "William Shakespeare", "Jane Austen", "Mark Twain"), "William Shakespeare"),
     "William Shakespeare wrote Romeo and Juliet in the sixteenth century in England."),
    (MCQuestion("What is the largest country in the world by area?", ("Canada", "China", "Russia", "Brazil"),
                "Russia"),
     "Russia spans eleven time zones across Europe and Asia, more land than any other country."),
    (MCQuestion("How many hours are there in one day?", ("twelve", "twenty", "twenty-four", "thirty"),
                "twenty-four"),
     "The Earth turns once on its axis in about twenty-four hours, which is one day."),
    (MCQuestion("Which instrument has black and white keys?", ("Violin", "Drum", "Piano", "Trumpet"), "Piano"),
     "A piano has eighty-eight keys, the white ones for natural notes and the black ones for sharps."),
)

# The questions the benchmark asks (none of them appears among the examples above).
QUESTIONS: tuple[MCQuestion, ...] = (
    MCQuestion("What is the capital of Italy?", ("Rome", "Vienna", "Athens", "Lisbon"), "Rome"),
    MCQuestion("What is the capital of Japan?", ("Beijing", "Seoul", "Tokyo", "Bangkok"), "Tokyo"),
    MCQuestion("Which planet is the largest in our solar system?", ("Earth", "Mercury", "Mars", "Jupiter"),
               "Jupiter"),
    MCQuestion("How many months are there in a year?", ("ten", "twelve", "fourteen", "eight"), "twelve"),
    MCQuestion("What is the freezing point of water in degrees Celsius?", ("0", "10", "32", "100"), "0"),
    MCQuestion("Which animal is known as the king of the jungle?", ("Lion", "Rabbit", "Horse", "Sheep"), "Lion"),
    MCQuestion("What do bees make?", ("Milk", "Honey", "Silk", "Wool"), "Honey"),
    MCQuestion("What is the capital of Germany?", ("Munich", "Hamburg", "Berlin", "Frankfurt"), "Berlin"),
    MCQuestion("Which star is at the center of our solar system?", ("The Moon", "The Sun", "Sirius", "Polaris"),
               "The Sun"),
    MCQuestion("How many continents are there on Earth?", ("five", "six", "seven", "nine"), "seven"),
    MCQuestion("What is the largest ocean on Earth?",
               ("Atlantic Ocean", "Pacific Ocean", "Indian Ocean", "Arctic Ocean"), "Pacific Ocean"),
    MCQuestion("Which color is the sky on a clear sunny day?", ("Green", "Red", "Blue", "Black"), "Blue"),
    MCQuestion("How many sides does a triangle have?", ("three", "four", "five", "six"), "three"),
    MCQuestion("What is the capital of Spain?", ("Barcelona", "Madrid", "Seville", "Valencia"), "Madrid"),
    MCQuestion("Which metal is liquid at room temperature?", ("Iron", "Gold", "Mercury", "Copper"), "Mercury"),
    MCQuestion("What is the opposite of hot?", ("Warm", "Cold", "Wet", "Loud"), "Cold"),
)


def format_question(q: MCQuestion) -> str:
    """The question block up to and including "Answer:" (the choice follows after a space)."""
    options = "\n".join(f"{letter}. {text}" for letter, text in zip(_LETTERS, q.options))
    return f"Question: {q.question}\n{options}\nAnswer:"


def few_shot_prefix() -> str:
    parts = [INSTRUCTIONS]
    for q, reason in FEW_SHOT:
        parts.append(f"{format_question(q)} {q.answer}\nReason: {reason}\n\n")
    return "".join(parts)


def choice_texts(q: MCQuestion) -> list[str]:
    """What `select` scores after "Answer:": each option with its leading space."""
    return [" " + o for o in q.options]


# ---- lang-overhead: one gen per program -----------------------------------------------------

_TOPICS = (
    "the ocean", "a mountain village", "autumn leaves", "a busy train station", "the first snow", "a lighthouse",
    "a quiet library", "the desert at night", "a city market", "a thunderstorm", "an old bridge", "a garden in spring",
    "a long road trip", "the moon", "a river at dawn", "a bakery",
)
_STYLES = ("Write one sentence about", "Describe in a few words", "Tell a very short story about",
           "Give a friendly fact about")


def overhead_prompts(count: int) -> list[str]:
    """`count` distinct plain prompts (no shared prefix beyond a few words)."""
    prompts = []
    for i in range(count):
        topic, style = _TOPICS[i % len(_TOPICS)], _STYLES[(i // len(_TOPICS)) % len(_STYLES)]
        prompts.append(f"Request {i}: {style} {topic}.\nAnswer:")
    return prompts
