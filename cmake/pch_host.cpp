int main() { return 0; }  // hosts the precompiled header that programs reuse
