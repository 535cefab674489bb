"""What a remembered exchange reads like: prose, not a transcript (a small model shown a transcript
continues it instead of answering: measured, docs/guides/chat-memory.md).

KEEPS says what of an exchange is kept: "exchange" the user's words and the reply; "user" the user's
words alone (a model's reply is often no content, and a remembered reply is what a small model
continues instead of answering: benchmarks/bench_chat_recall.py)."""

TURN = "On {day}, the user said: {user}\nYou replied: {reply}\n"
TURN_USER = "On {day}, the user said: {user}\n"
KEEPS = ("exchange", "user")
# the order recalled turns take in a window (ChatMemory.order): oldest first, or the most relevant last
ORDERS = ("time", "relevance")
REPLIED = "\nYou replied: "


def turn_text(keep: str, day: str, user: str, reply: str) -> str:
    """The text a remembered exchange is deposited as (keep: KEEPS)."""
    if keep == "user":
        return TURN_USER.format(day=day, user=user)
    return TURN.format(day=day, user=user, reply=reply)


def said(turn_text: str) -> str:
    """The user's words of a remembered turn's text."""
    if REPLIED not in turn_text and turn_text.endswith("\n"):
        turn_text = turn_text[:-1]
    return turn_text.split(REPLIED)[0].split(", the user said: ", 1)[-1]
