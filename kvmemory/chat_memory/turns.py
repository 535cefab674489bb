"""What a remembered exchange reads like: prose, not a transcript (a small model shown a transcript
continues it instead of answering: measured, README "Memory for chat assistants")."""

TURN = "On {day}, the user said: {user}\nYou replied: {reply}\n"


def said(turn_text: str) -> str:
    """The user's words of a remembered turn's text."""
    return turn_text.split("\nYou replied: ")[0].split(", the user said: ", 1)[-1]
