"""kvmemory.index: chunk selection (one vector per block, FAISS search). Installed as kvmemory.index."""
