import streamlit as st

st.title("inventory")
st.info("This page is being built.")
