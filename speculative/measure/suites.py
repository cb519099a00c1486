"""Prompt suites for `dyno bench`, sized for the bundled model (Python-code trained) and usable
with real models. Each prompt is raw text unless `chat` is set."""

SUITES = {
    "code": [
        {"prompt": "import os\nimport sys\n\n\ndef walk_files(root):\n    \"\"\"Yield every file path under root.\"\"\"\n"},
        {"prompt": "class LRUCache:\n    \"\"\"A least-recently-used cache with a fixed capacity.\"\"\"\n\n    def __init__(self, capacity):\n"},
        {"prompt": "def parse_args(argv=None):\n    import argparse\n    parser = argparse.ArgumentParser(description=__doc__)\n"},
    ],
    "reasoning": [
        {"prompt": "def is_prime(n):\n    # Step 1: numbers below 2 are not prime.\n    # Step 2: check divisors up to the square root.\n"},
        {"prompt": "# Compute the median of a list step by step.\n# First sort the values, then pick the middle one.\ndef median(values):\n"},
    ],
    "edit": [
        {"prompt": "def area(width, height):\n    \"\"\"Return the area of a rectangle.\"\"\"\n    return width * height\n\n\n"
                   "def perimeter(width, height):\n    \"\"\"Return the perimeter of a rectangle.\"\"\"\n    return 2 * (width + height)\n\n\n"
                   "# The same two functions again, unchanged:\n\ndef area(width, height):\n"},
    ],
    "chat": [
        {"prompt": "Write a Python function that reverses a string.", "chat": True},
        {"prompt": "How do I read a file line by line in Python?", "chat": True},
    ],
}


def encode(tokenizer, item: dict) -> list:
    """A suite item's prompt as token ids (chat items through the tokenizer's chat template)."""
    if item.get("chat"):
        return tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}],
                                             add_generation_prompt=True, tokenize=True)
    return tokenizer.encode(item["prompt"])
