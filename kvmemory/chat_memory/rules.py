"""The rules recall keeps turns by (ChatMemory.recall), each a default with the measurement behind it, and
`refine`: the rules applied after the cut (an update kept, a correction standing alone, the dense ranking's
best turn kept too)."""

from __future__ import annotations

import re

# the order recalled turns take in the window: "time" (oldest first, as they were said) or "relevance" (the
# most relevant last, nearest the new message)
ORDER = "time"
# a recalled turn after the most relevant one needs this fraction of its BM25 score (0: the k best turns,
# however weak): a far less relevant turn is a distractor to a small model (ask's min_relevance, the same
# 0.75); with COVER, one below it holding a content word of the question no kept turn holds comes still at
# half the best's score (the second fact of "What is my locker code, and what is my sister's name?").
# Measured as KV against the k best (docs/guides/chat-memory.md, 2026-12-06): 200 probes of the model's own
# conversations (bench_chat_recall.py, histories seed 856338604) 72 -> 84 right (paired 30 / 18; without
# COVER 79); 160 probes at ~100K tokens a user (seed 91410147, without COVER) 50 -> 70 (28 / 8); the
# scripted benchmark (bench_chat_memory.py, seed 1865097120) 31 -> 32 (10 / 9; without COVER 30)
MIN_RELEVANCE = 0.75
COVER = True
# a turn recalled after the most relevant one must hold a content word of the question (not a stopword of
# bm25s' longer list): BM25 keeps "what", "my", "do", rare in a user's statements, so "What is a haiku?"
# passes the cut for "What is my flat number?", and grafted, the model answers the recalled question ("A
# haiku is..."). Measured as KV on two fresh draws of 200 probes of the model's own conversations
# (bench_chat_recall.py, 2026-12-06; docs/guides/chat-memory.md): 89 -> 97 right (histories seed 488028631)
# and 83 -> 89 (seed 370187567, drawn after the choice); quoted as text 97 -> 94 and 99 -> 100
ON_TOPIC = True
TOPIC_FIRST = True
# what BM25 ranks for a question: "held", only the turns holding a content word of it (bm25s' longer stopword
# list: not "what", "is", "my"), each scored on all its words ("my" still counts among them); "content", its
# content words alone; "all", every turn on all its words. On all of them BM25 ranked first a turn sharing
# only such words with the question ("What is a haiku?" for "What is my job?", "How do I remove a coffee
# stain?" for "What car do I drive?": 21 of the 29 answers KV trailed the oracle by on the eighth draw were
# such misses); held, a question sharing no content word with any turn is answered by the dense ranking
# (MiniLM), which finds "I work as a librarian". Measured as KV on a fresh draw of 200 probes of the model's
# own conversations (bench_chat_recall.py, 2026-12-07, histories seed 1722279555, AMD EPYC): the told value
# recalled for 174 -> 191 questions, 123 -> 135 right (content 136; the fact alone 156); at ~100K tokens a
# user (seed 1997234457): 48 -> 54 of 60 recalled, 40 -> 41 right (content 38: a docstring's "context
# manager" outranked "My manager Astrid ..." without "my")
LEXICALS = ("all", "content", "held")
LEXICAL = "held"
# a turn said after the best one, holding a word of the question the best holds, kept under the cut (an update
# of it: "I changed my locker combination" after "My gym locker combination is ..."). Off: on the same draw
# (with lexical "content") it found one more told value (192) and answered 10 fewer (126 against 136; 11 lost,
# 1 gained): the later turns it added were mostly another fact sharing a word with the best ("favourite" of a
# food for "What is my favourite colour?"), not an update
NEWER = False
# of kept turns holding the same content words of the question, only the newest (a correction stands for
# what it corrects: "They reset the door code at work to 2213." for "The door code at work is 5446."). On since
# 2026-12-07: as KV on two fresh draws of 200 probes of the model's own conversations (bench_chat_recall.py,
# AMD EPYC) 147 -> 148 right (histories seed 48666200; 2 gained, 1 lost) and 138 -> 143 (seed 1532797189,
# drawn after the choice of the ones before; 5 / 0, corrections 6 -> 11 of 15); draw 9 (read to build it)
# 135 -> 143; ~100K tokens a user 41 -> 42 of 60; the scripted benchmark 44 = 44 of 99 (seed 227183316, the
# same 99 answers). A turn asking something neither stands for another nor is stood for ("What is my locker
# code?" asked again is no new code; the same turns kept on draws 10 and 11). A statement adding to an earlier
# one ("I also speak German" after "I speak French") does not stand for it (ADDITIVE)
SUPERSEDE = True
# the dense ranking's best turn (MiniLM) kept too, room permitting: BM25 cannot see a turn holding no word of
# the question ("I work as a librarian" for "What do I do for a living?", where the stemmed "live" of "I live
# in flat 957" holds its word), and the cut drops one that lost to another holding the same word ("My flat
# number is 957." behind "How do I fix a flat bicycle tyre?" for "Which flat do I live in?"). Off: the told
# value recalled 187 -> 191 of 200 (draw 10), 191 -> 195 (draw 9), 188 -> 192 (draw 11), but on draw 11, the
# fresh one, 143 -> 141 right as KV (3 gained, 5 lost: the dense best is often another name, "My sister is
# called Tomas." for "What is my brother's name?", and the model answers it)
DENSE = False
# with supersede, a statement that adds to what the user told ("I also speak German", "a second dog", "... as well")
# does not stand for the turns before it holding the same words of the question: they are kept with it (a later
# statement that does not add stands for them all again). ADDING: the words English adds with; a statement adding
# without them ("Last year I became fluent in Greek.") is taken for a correction. On since 2026-12-07: as KV on
# a draw of 110 corrected or added-to facts (bench_chat_recall.py --kinds ... --change 1, histories seed
# 1489498323, AMD EPYC) 43 -> 51 right (8 gained, 0 lost; added to 0 -> 8 of 50, corrected 43 = 43 of 60; without
# supersede 36, of which corrected 28); on draws 9, 10 and 11 (600 probes, none added to) the same turns kept
ADDITIVE = True
ADDING = re.compile(r"\b(also|too|as well|another|second|other|both|in addition|additionally|besides)\b", re.IGNORECASE)


def adds(words: str) -> bool:
    """Whether a user's words add to what they told before (hold one of ADDING's words)."""
    return ADDING.search(words) is not None


def refine(kept: list, cands: list, k: int, held, turn, when, newer: bool, supersede: bool, dense_top=None,
           asks=None, added=None) -> list:
    """The turns kept after the cut, refined. held(h) -> the question's content terms turn h holds; turn(h) ->
    its turn's id; when(h) -> when it was said (time, turn); dense_top: the dense ranking's best turn (a Ranked),
    or None; asks(h) -> whether the user's words of turn h ask something (hold a question mark).
    newer: a turn said after the best one, holding a word of the question it holds, comes under the cut (its
    update); dense_top comes too where it is not kept and there is room; supersede: of the kept turns holding
    the same words of the question, the newest alone, a question neither standing for a turn nor stood for
    (the user asking "What is my locker code?" again tells nothing: it does not replace the code told); added(h)
    -> whether turn h adds to what was told (adds()): kept beside the earlier turns it would otherwise stand for."""
    if newer and kept and held(kept[0]):
        best = kept[0]
        for h in cands[1:k]:
            if len(kept) < k and h not in kept and held(h) & held(best) and when(h) > when(best):
                kept.append(h)
    if dense_top is not None and len(kept) < k and turn(dense_top) not in {turn(h) for h in kept}:
        kept.append(dense_top)
    if supersede:
        told = [h for h in kept if held(h) and not (asks and asks(h))]
        last: dict = {}                   # the newest told turns for each set of the question's words held
        for h in sorted(told, key=when):  # (one, or the one and those adding to it after it)
            key = frozenset(held(h))
            last[key] = last.get(key, []) + [h] if added and added(h) else [h]
        stand = {id(h) for group in last.values() for h in group}
        kept = [h for h in kept if h not in told or id(h) in stand]
    return kept
