"""LangChain adapters with the real framework and the real default model: the standard retriever
suite, the QA runnable inside chains, the chat model and embeddings in a FAISS text-RAG chain."""

import asyncio

import pytest

pytest.importorskip("langchain_core")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableLambda  # noqa: E402
from langchain_tests.integration_tests import RetrieversIntegrationTests  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from kvmemory.errors import InputError  # noqa: E402
from kvmemory.integrations._common import chat_complete  # noqa: E402
from kvmemory.integrations.langchain import (KVMemoryChatModel, KVMemoryQA, KVMemoryRetriever,  # noqa: E402
                                             MiniLMEmbeddings)

from tests.integrations.conftest import import_error_without  # noqa: E402

pytestmark = pytest.mark.real_model


class TestKVMemoryRetrieverStandard(RetrieversIntegrationTests):
    """LangChain's own standard suite (langchain-tests), unmodified."""

    @pytest.fixture(autouse=True)
    def _memory(self, real_mem):
        self.mem = real_mem

    @property
    def retriever_constructor(self):
        return KVMemoryRetriever

    @property
    def retriever_constructor_params(self):
        return {"memory": self.mem, "k": 2}

    @property
    def retriever_query_example(self):
        return "In which locker is it kept?"


def test_retriever_documents_are_memory_retrieve(real_mem, corpus):
    docs, facts = corpus
    doc_id, question, code = facts[0]
    r = KVMemoryRetriever(memory=real_mem, k=3)
    got = r.invoke(question)
    want = real_mem.retrieve(question, k=3)
    assert [d.page_content for d in got] == [h["text"] for h in want]
    assert [d.metadata["score"] for d in got] == [h["score"] for h in want]
    top = got[0]
    assert isinstance(top, Document) and top.metadata["doc_id"] == doc_id
    assert top.metadata["source"] == f"/data/{doc_id}.txt" and top.metadata["selector"] == "text"
    ids = real_mem.tokenizer(docs[doc_id], add_special_tokens=False)["input_ids"]
    assert top.page_content == real_mem.tokenizer.decode(ids[top.metadata["start_token"]:top.metadata["end_token"]])
    assert top.id == f"{doc_id}:{top.metadata['start_token']}-{top.metadata['end_token']}"
    # the top block holds (part of) the planted fact (a fact that straddles a block boundary is
    # found by either half), or the fact ends the block before it, whose last 32 word pieces lead
    # the block's first window (index/windows.py); ask grafts the neighbours with it, and
    # test_query_engine checks the answer
    enc = real_mem.tokenizer(docs[doc_id], add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids
    item = question.removeprefix("In which locker is the ").removesuffix(" kept?")
    fact = f"The {item} is kept in locker number {code}."
    c0 = docs[doc_id].index(fact)
    c1 = c0 + len(fact)
    fact_tokens = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if a < c1 and b > c0]
    s0, s1 = top.metadata["start_token"], top.metadata["end_token"]
    holds = bool(fact_tokens) and s0 <= fact_tokens[-1] and fact_tokens[0] < s1
    from kvmemory.index import windows as win
    from kvmemory.index.embedder import shared_embedder
    emb = shared_embedder()
    lead = real_mem.tokenizer.decode(ids[max(0, s0 - real_mem.block_tokens):s0]) if s0 else None
    seen = win.block_windows(lambda t: emb.pieces(t)[0], [top.page_content], [lead])[0]
    leads_with_it = any(code in emb.tokenizer.decode(w).replace(" ", "") for w in seen)
    assert holds or leads_with_it, (fact_tokens, s0, s1, code)
    # async, per-call k and selector, doc_filter
    assert [d.id for d in asyncio.run(r.ainvoke(question))] == [d.id for d in got]
    assert len(r.invoke(question, k=1)) == 1
    assert all(d.metadata["selector"] == "bm25" for d in r.invoke(question, selector="bm25"))
    only = KVMemoryRetriever(memory=real_mem, k=3, doc_filter=lambda d: d == facts[1][0]).invoke(question)
    assert {d.metadata["doc_id"] for d in only} == {facts[1][0]}
    with pytest.raises(InputError):
        r.invoke(question, k=0)
    with pytest.raises(InputError):
        r.invoke("   ")
    with pytest.raises(ValidationError):
        KVMemoryRetriever(memory=real_mem, k=0)
    with pytest.raises(ValidationError):
        KVMemoryRetriever(memory="not a memory")


def test_qa_answers_from_grafted_kv_like_ask(real_mem, corpus):
    _, facts = corpus
    doc_id, question, code = facts[1]
    qa = KVMemoryQA(memory=real_mem, max_new_tokens=24)
    out = qa.invoke(question)
    ans = real_mem.ask(question, max_new_tokens=24)
    assert out["answer"] == ans.text
    assert [(d.metadata["doc_id"], d.metadata["start_token"], d.metadata["end_token"]) for d in out["sources"]] == \
        [s[:3] for s in ans.sources]
    assert any(code in d.page_content for d in out["sources"])          # the grafted passage holds the fact
    st = out["stats"]
    assert st["tokens_restored"] > 0 and st["tokens_prefilled"] < 60 and "ttft" in st["timings_s"]
    # the same through dict input, stream (chunks add up to invoke's output), astream, a chain
    assert qa.invoke({"question": question})["answer"] == out["answer"]
    chunks = list(qa.stream(question))
    assert len(chunks) > 2 and all(set(c) <= {"answer", "sources", "stats"} for c in chunks)
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total["answer"] == out["answer"]
    assert [d.id for d in total["sources"]] == [d.id for d in out["sources"]]

    async def collect():
        return [c async for c in qa.astream(question)]
    assert "".join(c.get("answer", "") for c in asyncio.run(collect())) == out["answer"]
    chain = RunnableLambda(lambda x: x["q"]) | qa | RunnableLambda(lambda o: o["answer"].upper())
    assert chain.invoke({"q": question}) == out["answer"].upper()
    assert qa.batch([question, facts[2][1]])[0]["answer"] == out["answer"]
    with pytest.raises(InputError):
        qa.invoke({"text": question})
    with pytest.raises(InputError):
        qa.invoke(42)


def test_qa_stream_stops_decoding_when_the_consumer_leaves(real_mem, corpus):
    question = corpus[1][0][1]
    qa = KVMemoryQA(memory=real_mem, max_new_tokens=40)
    it = qa.stream(question)
    first = next(it)
    assert first.get("answer")
    it.close()                 # the consumer went away: the decode thread stops, the memory is free again
    assert real_mem.retrieve(question, k=1)


def test_chat_model_in_a_prompt_chain(real_mem):
    llm = KVMemoryChatModel(memory=real_mem, max_new_tokens=20)
    msgs = [("system", "Be brief."), ("human", "Name a colour of the sky.")]
    m = llm.invoke(msgs)
    text, stats = chat_complete(real_mem, [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Name a colour of the sky."}], 20)
    assert m.content == text and text
    assert m.usage_metadata["input_tokens"] == stats["tokens_prefilled"]
    assert m.usage_metadata["output_tokens"] == stats["tokens_decoded"]
    streamed = "".join(c.content for c in llm.stream(msgs))
    assert streamed == text
    cut = text.split()[1]                        # a stop string inside the answer ends it before it
    stopped = llm.invoke(msgs, stop=[cut])
    assert stopped.content == text[:text.index(cut)] and stopped.response_metadata["finish_reason"] == "stop"
    assert cut not in stopped.content and cut not in "".join(c.content for c in llm.stream(msgs, stop=[cut]))
    chain = ChatPromptTemplate.from_messages([("system", "Be brief."), ("human", "{q}")]) | llm | StrOutputParser()
    assert chain.invoke({"q": "Name a colour of the sky."}) == text
    from langchain_core.messages import ToolMessage
    with pytest.raises(InputError):
        llm.invoke([ToolMessage(content="x", tool_call_id="1")])


def test_embeddings_in_a_faiss_vector_store(real_mem, corpus):
    import numpy as np
    from langchain_community.vectorstores import FAISS

    from kvmemory.index.embedder import shared_embedder
    emb = MiniLMEmbeddings()
    texts = ["The ferry leaves at dawn.", "Comets have tails of dust.", "Bread is baked at night."]
    vecs = np.array(emb.embed_documents(texts))
    assert vecs.shape == (3, 384) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    assert np.array_equal(np.float32(emb.embed_query(texts[1])), shared_embedder().embed([texts[1]])[0])
    store = FAISS.from_texts(texts, emb)
    assert store.similarity_search("When does the boat depart?", k=1)[0].page_content == texts[0]


def test_missing_extra_names_it():
    msg = import_error_without(['langchain_core'], "kvmemory.integrations.langchain")
    assert "pip install 'kvmemory[langchain]'" in msg
