from services.cli import main

main(["worker"])
