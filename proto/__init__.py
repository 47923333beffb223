"""The contracts: .proto files and the Python code generated from them."""
