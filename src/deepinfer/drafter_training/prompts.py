"""Chat prompts for self-distillation and for measuring a drafter on prompts it never saw.

Every prompt is an instruction template written for this project filled with a topic from a
list written for it, so the prompts carry no third-party text and no licence beyond the
project's own; the replies a head learns from are the target's own generations. The training
and held-out sets share no template and no topic.
"""

from __future__ import annotations

import random

TRAIN_TEMPLATES = (
    "Explain {topic} to a curious ten-year-old.",
    "Write a short paragraph about {topic}.",
    "What are three interesting facts about {topic}?",
    "Give me a simple definition of {topic}.",
    "Why do people care about {topic}?",
    "Write a short poem about {topic}.",
    "List the main ideas behind {topic}.",
    "How would you describe {topic} to a friend?",
    "Write a brief story that involves {topic}.",
    "What is the history of {topic}, in a few sentences?",
    "Give some tips for learning about {topic}.",
    "What are the pros and cons of {topic}?",
    "Summarize what you know about {topic}.",
    "Write an email to a colleague about {topic}.",
    "What questions should a beginner ask about {topic}?",
    "Describe a day in the life of someone who works with {topic}.",
    "Compare {topic} with something from everyday life.",
    "Write a short speech about {topic}.",
    "What are common misconceptions about {topic}?",
    "How has {topic} changed over time?",
)

HELD_OUT_TEMPLATES = (
    "Can you tell me about {topic}?",
    "Teach me the basics of {topic}.",
    "Write a few sentences on why {topic} matters.",
    "What should everyone know about {topic}?",
    "Describe {topic} in simple words.",
    "Write a friendly note that mentions {topic}.",
)

TRAIN_TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "the moon", "honey bees", "rainbows",
    "the human heart", "electricity", "magnets", "dinosaurs", "the ocean", "clouds",
    "gravity", "the solar system", "recycling", "forests", "deserts", "earthquakes",
    "the internet", "computers", "cooking pasta", "baking bread", "gardening", "chess",
    "soccer", "basketball", "swimming", "running a marathon", "meditation", "sleep",
    "healthy eating", "drinking water", "friendship", "kindness", "teamwork", "leadership",
    "time management", "saving money", "budgeting", "starting a business", "job interviews",
    "public speaking", "writing a resume", "learning a language", "reading books",
    "libraries", "museums", "music", "the piano", "the guitar", "painting", "photography",
    "movies", "theater", "poetry", "history", "ancient Egypt", "the Roman Empire",
    "the printing press", "trains", "airplanes", "bicycles", "electric cars", "bridges",
    "skyscrapers", "castles", "mountains", "rivers", "lakes", "islands", "penguins",
    "elephants", "dolphins", "owls", "cats", "dogs", "horses", "butterflies", "ants",
    "spiders", "trees", "flowers", "mushrooms", "coffee", "tea", "chocolate", "apples",
    "rice", "bread", "cheese", "vitamins", "exercise", "yoga", "the brain", "memory",
    "dreams", "emotions", "happiness", "stress", "habits", "motivation", "creativity",
    "curiosity", "science", "mathematics", "fractions", "geometry", "algebra", "statistics",
    "probability", "physics", "chemistry", "biology", "atoms", "cells", "DNA", "vaccines",
    "the immune system", "bacteria", "weather", "climate", "snow", "thunderstorms",
    "the sun", "stars", "comets", "telescopes", "robots", "artificial intelligence",
    "programming", "Python", "databases", "passwords", "online safety", "email",
    "social media", "video games", "board games", "puzzles", "holidays", "birthdays",
    "weddings", "travel", "camping", "hiking", "the beach", "cities", "villages", "farms",
    "tractors", "bees and pollination", "composting", "solar power", "wind energy",
    "batteries", "light bulbs", "clocks", "calendars", "maps", "compasses",
)

HELD_OUT_TOPICS = (
    "glaciers", "owls at night", "the violin", "sailing", "origami", "the Great Wall",
    "submarines", "kangaroos", "lightning", "bread baking at home", "the periodic table",
    "saving energy at home", "tidal waves", "bird migration", "the first airplanes",
    "coral reefs", "rock climbing", "jazz", "knitting", "the Olympic Games", "volunteering",
    "learning to swim", "fire safety", "packing for a trip",
)


def chat_prompts(count: int, seed: int, held_out: bool = False) -> list[list[dict[str, str]]]:
    """``count`` single-turn conversations, each a distinct (template, topic) pair drawn with
    ``seed``; ``held_out``: from the held-out templates and topics."""
    templates = HELD_OUT_TEMPLATES if held_out else TRAIN_TEMPLATES
    topics = HELD_OUT_TOPICS if held_out else TRAIN_TOPICS
    pairs = [(t, s) for t in templates for s in topics]
    if count > len(pairs):
        raise ValueError(f"count: at most {len(pairs)} distinct prompts, got {count}")
    chosen = random.Random(seed).sample(pairs, count)
    return [[{"role": "user", "content": t.format(topic=s)}] for t, s in chosen]
