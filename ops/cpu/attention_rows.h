// Which rows of a pagedserve::paged_attention call the decode kernel attends, and as what: each one-token
// row as one decode row, each row of at most `max_tokens` new tokens (a speculative verify row) as one decode
// row per token over the positions that token sees; longer rows (prefill chunks) are left to the caller.
#pragma once

#include <cstdint>
#include <vector>

namespace pagedserve_cpu::attention {

// The rows with more than `max_tokens` new tokens (prefill chunks, which the caller attends), or -1 where
// the rows' lengths do not fit (0 <= new tokens <= context_lens <= the table's positions, query_start_loc
// from 0 and within q); the caller then says which row is wrong. Checked here, once per call, so the caller
// need not walk the rows in Python in every layer.
inline int64_t prefill_rows(const int32_t* starts, const int32_t* lens, int64_t rows, int64_t positions,
                            int64_t tokens, int64_t max_tokens) {
  if (starts[0] != 0 || starts[rows] > tokens) return -1;
  int64_t prefill = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = starts[r + 1] - starts[r];
    if (n < 0 || n > lens[r] || lens[r] > positions) return -1;
    prefill += n > max_tokens;
  }
  return prefill;
}

// The decode rows of a call: every one-token row, and one per token of each row of at most `max_tokens`.
struct DecodeRows {
  std::vector<int32_t> tokens, lens, table_rows;
  DecodeRows(const int32_t* starts, const int32_t* ctx, int64_t rows, int64_t max_tokens) {
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t n = starts[r + 1] - starts[r];
      if (n < 1 || n > max_tokens) continue;
      for (int32_t j = 0; j < n; ++j) {
        tokens.push_back(starts[r] + j);
        lens.push_back(ctx[r] - n + 1 + j);
        table_rows.push_back(static_cast<int32_t>(r));
      }
    }
  }
};

}  // namespace pagedserve_cpu::attention
