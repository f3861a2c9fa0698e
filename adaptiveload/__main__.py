from adaptiveload.cli import main

main()
