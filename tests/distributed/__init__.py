"""kmp's tests: distributed."""
