"""The same LangChain app with kvmemory: the documents are read once (their KV stored on disk);
each question selects the relevant blocks, grafts their stored KV, prefills only the question and
answers. The chain keeps LangChain's interface (invoke/stream, Documents as sources).

    pip install -e '.[examples]'
    python examples/langchain_kvmemory.py [STORE]     # STORE: where the memory lives (kept)

Compare with langchain_faiss_rag.py: the same documents and questions, answered from text.
"""

import sys
import tempfile
import time

import kvmemory
from kvmemory.integrations.langchain import KVMemoryQA, KVMemoryRetriever
from town import FILES, QUESTIONS, correct, report

mem = kvmemory.Memory(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp() + "/town.kvm")
have = {d.doc_id for d in mem.docs()}
for f in FILES:                                   # read once; a second run finds them stored
    if f.name not in have:
        mem.add(f.read_text(), doc_id=f.name, source=str(f))

retriever = KVMemoryRetriever(memory=mem, k=4)    # a LangChain retriever, if the app wants passages
chain = KVMemoryQA(memory=mem, max_new_tokens=48)

rows = []
for question, expected in QUESTIONS:
    t0, ttft, answer = time.perf_counter(), None, ""
    for chunk in chain.stream(question):
        if ttft is None and chunk.get("answer"):
            ttft = time.perf_counter() - t0
        answer += chunk.get("answer", "")
    answer = answer.strip()
    rows.append((question, answer, correct(answer, expected), ttft or 0.0, time.perf_counter() - t0))
top = retriever.invoke(QUESTIONS[0][0])[0]
print(f"retriever: {QUESTIONS[0][0]!r} -> {top.metadata['doc_id']} tokens "
      f"{top.metadata['start_token']}-{top.metadata['end_token']}")
report(f"LangChain + kvmemory ({len(mem.docs())} documents stored as KV; answers graft it, no re-read)", rows)
mem.close()
sys.exit(0 if rows else 1)
