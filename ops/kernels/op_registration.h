#ifndef GROUP_EMBEDDING_OPS_KERNELS_OP_REGISTRATION_H_
#define GROUP_EMBEDDING_OPS_KERNELS_OP_REGISTRATION_H_

// The names of the library's ops and how they are registered.
//
// Every op is named `GroupEmbedding` + family + action, so that its global
// TF op name says which library it belongs to (DeepRec, Deepray and TF
// Recommenders-Addons register ops of their own, some with the same short
// names) and which family of kernels serves it:
//   plain-table lookups  GroupEmbeddingPooledLookup, ...ConcatLookup,
//                        ...SequenceLookup (+ Grad), ...ClipGrad,
//                        ...WeightGrad*, ...TableSnapshot
//   ids                  GroupEmbeddingSparseToRagged, ...UnpackIds
//   sparse apply         GroupEmbeddingSparseApplyAdagrad
//   EmbeddingVariable    GroupEmbeddingEV* (Handle, Lookup, Apply*, ...)
//   collective           GroupEmbeddingCollective* (RouteIds, Pool, ...)
//   transport            GroupEmbeddingPeerAllToAll
//
// Ops renamed to this scheme keep their old name registered as an alias:
// the same OpDef under the old name and the same CPU kernel, so that
// graphs saved before the rename (a TF1 MetaGraph or checkpoint graph
// holds the forward, gradient and apply ops of a training script) still
// import and run. ops/op_names.py lists the aliases for Python (gradient
// registrations, op-type checks); tests/ops/test_op_names.py checks both.

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"

// Registers op `name` and its pre-rename alias `old_name` from ONE spec,
// the `.Input(...).Output(...).Attr(...).SetShapeFn(...)` chain (commas
// inside its parentheses are fine in a macro argument).
#define GE_REGISTER_OP_WITH_ALIAS(name, old_name, spec) \
  REGISTER_OP(name) spec;                                \
  REGISTER_OP(old_name) spec

// Registers `kernel` as the CPU kernel of op `name` and of its alias.
#define GE_REGISTER_CPU_KERNEL_WITH_ALIAS(name, old_name, kernel)       \
  REGISTER_KERNEL_BUILDER(                                               \
      Name(name).Device(::tensorflow::DEVICE_CPU), kernel);              \
  REGISTER_KERNEL_BUILDER(                                               \
      Name(old_name).Device(::tensorflow::DEVICE_CPU), kernel)

#endif  // GROUP_EMBEDDING_OPS_KERNELS_OP_REGISTRATION_H_
