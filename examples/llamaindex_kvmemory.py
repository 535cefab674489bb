"""LlamaIndex, both ways on the same documents: a VectorStoreIndex query engine (chunks embedded,
retrieved and re-read as text by the model) and kvmemory's query engine (documents read once,
answers from their stored KV). Offline, with kvmemory's default model and MiniLM embedder.

    pip install -e '.[examples]'
    python examples/llamaindex_kvmemory.py [STORE]
"""

import sys
import tempfile
import time

from llama_index.core import Document, VectorStoreIndex

import kvmemory
from kvmemory.integrations.llama_index import KVMemoryLLM, KVMemoryQueryEngine, MiniLMEmbedding
from town import FILES, QUESTIONS, correct, report

mem = kvmemory.Memory(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp() + "/town.kvm")

# text RAG: what a LlamaIndex app does today
index = VectorStoreIndex.from_documents([Document(text=f.read_text(), metadata={"source": f.name}) for f in FILES],
                                        embed_model=MiniLMEmbedding())
text_engine = index.as_query_engine(llm=KVMemoryLLM(memory=mem, max_new_tokens=48), similarity_top_k=2,
                                    streaming=True)

# kvmemory: the same query-engine interface over grafted KV
have = {d.doc_id for d in mem.docs()}
for f in FILES:
    if f.name not in have:
        mem.add(f.read_text(), doc_id=f.name, source=str(f))
kv_engine = KVMemoryQueryEngine(mem, max_new_tokens=48, streaming=True)

for name, engine in [("LlamaIndex VectorStoreIndex, text re-read (top 2 chunks)", text_engine),
                     ("LlamaIndex + kvmemory query engine (grafted KV)", kv_engine)]:
    rows = []
    for question, expected in QUESTIONS:
        t0, ttft, answer = time.perf_counter(), None, ""
        response = engine.query(question)
        for delta in response.response_gen:
            if ttft is None and delta:
                ttft = time.perf_counter() - t0
            answer += delta
        answer = answer.strip()
        rows.append((question, answer, correct(answer, expected), ttft or 0.0, time.perf_counter() - t0))
    report(f"{name}; sources of the last answer: "
           f"{[n.node.metadata.get('doc_id', n.node.metadata.get('source')) for n in response.source_nodes]}", rows)
mem.close()
