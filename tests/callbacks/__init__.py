"""kmp's tests: callbacks."""
