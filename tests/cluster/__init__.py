"""kmp's tests: cluster."""
