#pragma once
// The CLI's view of an attention case: the shared case library
// (dimattn/testing/cases.h: the description, its operands, forced runs and
// comparisons) plus what only the command line needs.
#include <string>
#include <vector>

#include "cli_args.h"
#include "dimattn/tensor.h"
#include "dimattn/testing/cases.h"

namespace dimattn::cli {

using testing::AttentionCase;
using testing::Kind;
using testing::Layout;
using testing::kind_name;
using testing::make_operands;
using testing::max_abs;
using testing::max_abs_diff;
using testing::Operands;
using testing::rejection;
using testing::run_forced;

// Throws UsageError when the sizes and flags do not make one call (the
// case library's rule; the CLI also wants non-negative offsets).
void validate(const AttentionCase& p);

// The attention variants as options (one per scalar variant, made from
// AttentionVariants' fields: --window LEFT:RIGHT, --NAME X, --NAME; --alibi,
// --sinks, --bias, --mask: tensors made per case), shared by the subcommands
// that describe a call, and their values applied to a case.
std::vector<Option> with_variant_options(std::vector<Option> options);
void apply_variants(const Args& a, testing::CaseVariants& p);

// Throws UsageError naming `option` when a name is neither a kernel nor "auto".
void check_kernel_names(const std::string& option, const std::vector<std::string>& names);

// Waits for the device work that produced x (a no-op on the CPU).
void synchronize(const Tensor& x);

}  // namespace dimattn::cli
