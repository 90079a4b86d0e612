"""kmp's test suite. A package, so test modules in different folders may share a name."""
