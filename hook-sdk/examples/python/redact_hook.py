"""A Lattice redaction hook in Python, on the `lattice_hook` package.

Every tool result's text is scanned for emails, card numbers (Luhn-checked),
phone numbers and API-key-like tokens, which are replaced by the same
markers as the Rust example (`[REDACTED:email]`, `[REDACTED:card]`,
`[REDACTED:phone]`, `[REDACTED:api_key]`); the replacement is one text
block. A result with nothing to redact is kept. Model requests are not
handled (UNIMPLEMENTED): register it for the `tool_result` event only.

    pip install ./hook-sdk/python
    python3 hook-sdk/examples/python/redact_hook.py --listen 127.0.0.1:50074

The package brings the rest: health, reflection, a drain on SIGTERM
(--drain-ms), Lattice's 16 MiB message limit, TLS (--tls-cert, --tls-key,
--tls-client-ca), log lines carrying the query's trace_id (--log-format
json); with port 0 the first line printed is `listening on PORT`. Four
regular expressions over a result near 16 MiB take over a second here:
register it with `deadline_ms = 5000` and check it so, `lattice hook check
127.0.0.1:50074 --events tool_result --deadline-ms 5000`.
"""

import re

import lattice_hook

API_KEY = re.compile(
    r"\b(?:sk_(?:live|test)_[A-Za-z0-9]{16,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|AKIA[0-9A-Z]{16}|xox[abpr]-[A-Za-z0-9-]{10,}|(?:key|token)_[A-Za-z0-9]{24,})\b"
)
# The lookbehind starts a match only where a run of address characters
# starts: without it, a long run with no "@" costs quadratic time (a 1 MiB
# result took minutes; `lattice hook check` finds that).
EMAIL = re.compile(r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
DIGITS = re.compile(r"\d(?:[ -]?\d){12,18}")
PHONE = re.compile(r"(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]?\d{2,4}){1,4}")


def luhn(digits: str) -> bool:
    total = 0
    for i, c in enumerate(reversed(digits)):
        d = int(c)
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def redact(text: str) -> tuple[str, int]:
    """Returns the redacted text and how many values were replaced."""
    count = 0

    def sub(marker):
        def f(_m):
            nonlocal count
            count += 1
            return marker

        return f

    def card(m):
        nonlocal count
        digits = re.sub(r"\D", "", m.group(0))
        if 13 <= len(digits) <= 19 and luhn(digits):
            count += 1
            return "[REDACTED:card]"
        return m.group(0)

    def phone(m):
        nonlocal count
        s = m.group(0)
        digits = sum(c.isdigit() for c in s)
        if 7 <= digits <= 15 and any(c in s for c in "+ .-("):
            count += 1
            return "[REDACTED:phone]"
        return s

    text = API_KEY.sub(sub("[REDACTED:api_key]"), text)
    text = EMAIL.sub(sub("[REDACTED:email]"), text)
    text = DIGITS.sub(card, text)
    text = PHONE.sub(phone, text)
    return text, count


class Redact:
    def on_tool_result(self, call):
        text, count = redact(call.text)
        lattice_hook.log("tool result checked", tool=call.tool_name, tool_use_id=call.tool_use_id,
                         bytes=len(call.text), redacted=count)
        return text if count else None


if __name__ == "__main__":
    lattice_hook.run(Redact(), listen="127.0.0.1:50074", description="A Lattice redaction hook")
