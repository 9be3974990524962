// Compile-time row counts for register-blocked loops over up to 8 rows.
#pragma once

#include <cstdint>
#include <type_traits>

namespace pallas_attn {

constexpr int kMaxRows = 8;  // the largest count with_rows passes

// f(std::integral_constant<int, n>{}) for n = rows in 1 .. 7, else n = 8: a loop body templated
// on its row count keeps one accumulator array per row in registers.
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

}  // namespace pallas_attn
