// The torch library Ember's CPU kernels register their ops in: ember_cpu, or another name given with
// -DEMBER_CPU_NAMESPACE=... for a second build in the same process (the tests load one per instruction set).
#pragma once

#include <torch/library.h>

#ifndef EMBER_CPU_NAMESPACE
#define EMBER_CPU_NAMESPACE ember_cpu
#endif
// One more level of macros: TORCH_LIBRARY_* paste their namespace argument, which would not expand it.
#define EMBER_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define EMBER_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
