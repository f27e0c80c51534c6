"""The schemas and prompts structured-output tests share (tests/engine/test_constraint.py
in-process, tests/http/test_structured.py through the daemon): five shapes, ten prompts
each, every schema bounded (string lengths, item counts, number ranges) so that an answer
can always finish within its max_tokens. And a byte-level tokenizer (token i is byte i)
for grammar tests without a model (the fake engine's codec uses it too)."""

from __future__ import annotations


def text(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def closed(properties: dict) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


# name -> (schema, max_tokens, prompts): bounded so that each can finish within max_tokens
SCHEMAS: dict[str, tuple[dict, int, list[str]]] = {
    "object": (
        closed({"name": text(16), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
        48,
        [f"Describe {who}." for who in ("a doctor", "a child", "a painter", "a pilot", "a chef")]
        + [f"Describe {who}." for who in ("a teacher", "a fisherman", "a student", "a singer")]
        + ["Describe your neighbour."],
    ),
    "array": (
        {"type": "array", "items": text(12), "minItems": 1, "maxItems": 4},
        64,
        [
            f"Tags for {what}."
            for what in (
                "a post about cats",
                "a cooking blog",
                "a photo of Paris",
                "a physics lecture",
                "a song about rain",
                "a gardening guide",
                "a video about cars",
                "a history book",
                "a soup recipe",
                "a football match",
            )
        ],
    ),
    "enum": (
        closed(
            {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"enum": ["low", "medium", "high"]},
            }
        ),
        48,
        [
            "I love this phone!",
            "The food was cold and late.",
            "It is a chair.",
            "Best holiday ever.",
            "I will never come back.",
            "The meeting is at noon.",
            "What a wonderful surprise!",
            "The train was cancelled again.",
            "The sky is grey today.",
            "Thank you so much for your help!",
        ],
    ),
    "nested": (
        closed(
            {
                "city": closed({"name": text(16), "country": text(16)}),
                "sights": {"type": "array", "items": text(16), "maxItems": 2},
            }
        ),
        96,
        [
            f"Tell me about {city}."
            for city in (
                "Paris",
                "Tokyo",
                "Rome",
                "London",
                "Berlin",
                "Madrid",
                "Cairo",
                "Sydney",
                "New York",
                "Moscow",
            )
        ],
    ),
    "numbers": (
        closed(
            {
                "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
                "humidity_pct": {"type": "integer", "minimum": 0, "maximum": 100},
                "wind_kmh": {"type": "integer", "exclusiveMinimum": 0, "maximum": 300},
            }
        ),
        64,
        [
            f"The weather {where}, as JSON."
            for where in (
                "in Paris today",
                "in the Sahara at noon",
                "on a mountain top",
                "in London in winter",
                "in a storm at sea",
                "in Moscow in January",
                "in Singapore",
                "on a desert night",
                "on a spring morning",
                "in a hurricane",
            )
        ],
    ),
}


def byte_tokenizer_json() -> str:
    """A `tokenizers` tokenizer whose token i is the byte i (GPT-2's byte-level alphabet,
    no merges): what the grammar engine reads to know each fake token's bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    alphabet = {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()
