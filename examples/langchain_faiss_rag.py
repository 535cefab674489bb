"""A LangChain RAG app, the usual way: split the documents, embed the chunks into a FAISS vector
store, retrieve the top 4 for each question, paste their text into the prompt, let the model read
it all (prefill) and answer. Offline: kvmemory's default model and MiniLM embedder stand in for a
hosted LLM and embedding API.

    pip install -e '.[examples]'
    python examples/langchain_faiss_rag.py

Compare with langchain_kvmemory.py: the same documents and questions, answered from stored KV.
"""

import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*langchain-community.*")   # FAISS still lives there (0.4.2)
from langchain_community.vectorstores import FAISS
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_text_splitters import RecursiveCharacterTextSplitter

import kvmemory
from kvmemory.integrations.langchain import KVMemoryChatModel, MiniLMEmbeddings
from town import FILES, QUESTIONS, correct, report

mem = kvmemory.Memory(tempfile.mkdtemp() + "/model-only.kvm")       # here only to host the model

splitter = RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=100)
chunks = splitter.create_documents([f.read_text() for f in FILES], metadatas=[{"source": f.name} for f in FILES])
retriever = FAISS.from_documents(chunks, MiniLMEmbeddings()).as_retriever(search_kwargs={"k": 4})

prompt = ChatPromptTemplate.from_messages([
    ("system", "Answer the question using the document excerpts. Be brief."),
    ("human", "Document excerpts:\n{context}\n\nQuestion: {question}"),
])
llm = KVMemoryChatModel(memory=mem, max_new_tokens=48)


def format_docs(docs):
    return "\n\n".join(d.page_content for d in docs)


chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()

rows = []
for question, expected in QUESTIONS:
    t0, ttft, answer = time.perf_counter(), None, ""
    for delta in chain.stream(question):
        if ttft is None and delta:
            ttft = time.perf_counter() - t0
        answer += delta
    answer = answer.strip()
    rows.append((question, answer, correct(answer, expected), ttft or 0.0, time.perf_counter() - t0))
report(f"LangChain + FAISS text RAG ({len(chunks)} chunks, k=4, every answer re-reads its chunks)", rows)
mem.close()
sys.exit(0 if rows else 1)
