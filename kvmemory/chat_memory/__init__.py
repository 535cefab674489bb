"""Memory for chat assistants: one user's earlier turns, kept as exact KV in a namespace of their
own, recalled into any later session as KV (kvmemory/chat_memory/memory.py), grafted after a
session's restored prefix (graft.py)."""

from kvmemory.chat_memory.memory import ChatMemory, Forgotten, Recall, user_key

__all__ = ["ChatMemory", "Forgotten", "Recall", "user_key"]
