def add_parser(sub) -> None:
    pass
