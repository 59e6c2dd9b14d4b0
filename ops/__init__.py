"""Low-level kernels of group-embedding (`group_embedding.ops`): the fused
lookup, SparseTensor -> ragged conversion, sparse optimizer updates and the
C++ library that backs them. Not a public API: use `group_embedding`."""
