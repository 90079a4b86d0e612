"""kmp's tests: compat."""
